"""Image folders: ``root/<class>/**/<image>``, with classes and labels as torchvision's
``ImageFolder`` gives them.

The classes are the sorted names of the folders directly in ``root``; an image's label is
its class's index in that list. A class's images are the files under its folder (links to
folders followed) whose lower-cased name ends with an image extension (``.jpg .jpeg .png
.ppm .bmp .pgm .tif .tiff .webp``), in the order of a sorted walk: folder by folder, names
sorted within each. A class with no image is an error, as in torchvision.

Elements are ``{"image": ..., "label": int, "path": str}``: the file's bytes, or with
``decode=True`` an HWC uint8 RGB array. One split per chunk of ``split_size`` images.

An image that cannot be read or decoded (a truncated file, an image of more than
``max_pixels`` pixels) is an error naming its path, for that image only: under
``on_error="skip"`` it is counted and the next image is read.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from zloader._defaults import MAX_IMAGE_PIXELS
from zloader.errors import CodecError
from zloader.formats.base import Bad, FormatSource
from zloader.formats.image import decode_image
from zloader.storage import FileRef, list_dirs, list_tree

__all__ = ["IMAGE_EXTENSIONS", "ImageFolderSource", "find_images"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def find_images(root: str, storage_options: dict[str, Any] | None = None
                ) -> tuple[tuple[str, ...], tuple[FileRef, ...], tuple[int, ...]]:
    """The classes under ``root``, and each image's file and label.

    Raises:
        ValueError: ``root`` has no class folder, or a class has no image.
    """
    classes = tuple(list_dirs(root, storage_options))
    if not classes:
        raise ValueError(f"from_image_folder: no class folders in {root!r}")
    index = {name: i for i, name in enumerate(classes)}
    by_class: list[list[tuple[tuple[str, str], FileRef]]] = [[] for _ in classes]
    def image(relative: str) -> bool:  # (in a class folder)
        top, _, rest = relative.partition("/")
        return bool(rest) and top in index and relative.lower().endswith(IMAGE_EXTENSIONS)

    for relative, ref in list_tree(root, storage_options, "from_image_folder", image):
        by_class[index[relative.partition("/")[0]]].append((relative.rpartition("/")[::2],
                                                            ref))
    empty = [name for name, found in zip(classes, by_class, strict=True) if not found]
    if empty:
        raise ValueError(f"from_image_folder: no image in class folder(s) {empty} of "
                         f"{root!r} (extensions: {' '.join(IMAGE_EXTENSIONS)})")
    files: list[FileRef] = []
    labels: list[int] = []
    for label, found in enumerate(by_class):
        for _, ref in sorted(found, key=lambda item: item[0]):
            files.append(ref)
            labels.append(label)
    return classes, tuple(files), tuple(labels)


@dataclass(frozen=True, eq=False, kw_only=True)
class ImageFolderSource(FormatSource):
    """Images and labels of a class-per-folder tree; one unit per chunk of images."""

    kind: ClassVar[str] = "from_image_folder"
    root: str
    classes: tuple[str, ...]
    labels: tuple[int, ...]
    split_size: int
    decode: bool
    max_pixels: int = MAX_IMAGE_PIXELS

    @property
    def units(self) -> Sequence[int]:
        return range(math.ceil(len(self.files) / self.split_size))

    def unit_name(self, unit: Any) -> str:
        first = unit * self.split_size
        last = min(len(self.files), first + self.split_size) - 1
        return f"images {first}..{last} of {self.root}"

    def read_unit(self, unit: Any) -> Iterator[Any]:
        first = unit * self.split_size
        for number in range(first, min(len(self.files), first + self.split_size)):
            path = self.files[number][0]
            try:
                with self.open(number) as stream:
                    image: Any = stream.read()
                if self.decode:
                    image = decode_image(image, max_pixels=self.max_pixels)
            except OSError as exc:  # a StorageError: it names the path
                yield Bad(exc, f"image {path}")
                continue
            except ValueError as exc:
                yield Bad(CodecError(f"{path}: {exc}"), f"image {path}")
                continue
            yield {"image": image, "label": self.labels[number], "path": path}

    def _format_options(self) -> tuple[Any, ...]:
        return (self.classes, self.labels, self.split_size, self.decode, self.max_pixels)

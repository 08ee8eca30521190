"""Builds zloader's optional compiled core (zloader/_core.pyx, zloader/_native.py); setup.cfg
holds everything else. Without Cython or a C compiler the build goes on without it, with a
warning, and zloader runs its pure-Python twins."""

import logging

from setuptools import setup
from setuptools.command.build_ext import build_ext

log = logging.getLogger("zloader.setup")


class OptionalBuildExt(build_ext):
    """``build_ext`` that leaves an extension out, saying why, when it fails to build."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # (no compiler at all)
            log.warning("zloader: the compiled core was not built (%s); the pure-Python "
                        "kernels are used", exc)

    def build_extension(self, ext) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            log.warning("zloader: %s was not built (%s); the pure-Python kernels are used",
                        ext.name, exc)


def extensions() -> list:
    try:
        import numpy
        from Cython.Build import cythonize
    except ImportError as exc:
        log.warning("zloader: %s is missing, the compiled core is not built", exc.name)
        return []
    from setuptools import Extension

    core = Extension("zloader._core", ["zloader/_core.pyx"],
                     include_dirs=[numpy.get_include()],
                     define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")])
    return cythonize([core], quiet=True, compiler_directives={"language_level": 3})


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})

"""Sharing one pipeline run among many trainers: the options that decide which Loaders
share a job (:mod:`zloader.sharing.options`) and the sliding window a worker keeps per shared
job (:mod:`zloader.sharing.window`). See docs/sharing.md."""

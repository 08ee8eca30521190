"""Sharing one pipeline run among many trainers, as data: the options that decide which
Loaders share a job (:mod:`zloader.sharing.options`), the sliding window a worker keeps per
shared job (:mod:`zloader.sharing.window`) and the records it keeps
(:mod:`zloader.sharing.store`). The worker's delivery of a shared job, which uses them, is
:mod:`zloader.worker.shared`. See docs/sharing.md."""

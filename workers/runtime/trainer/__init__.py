"""The builtin trainer: what torchrun runs for builtin and factory jobs
(`python -m workers.runtime.trainer.train`), apart from what user scripts call (`report()` and
the rest of `workers.runtime`), which it uses like any script does.

Empty on purpose: importing one of its modules (the DataLoader workers' forkserver imports
`loader_server`) loads only what that module needs.
"""

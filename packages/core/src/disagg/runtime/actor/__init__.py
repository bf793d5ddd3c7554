"""Code that runs inside the Ray actors (one process per rank of a module
group). Everything else under ``disagg.runtime`` runs in the driver process;
the two sides meet only through Ray calls on :class:`ModuleWorker`."""

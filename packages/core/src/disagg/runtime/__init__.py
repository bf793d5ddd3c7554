"""The Ray runtime. Modules here run in the driver process (routing, the
step's orchestration, groups, the run loop, checkpoints); ``actor/`` holds
what runs inside each rank's actor process. Plugins never import this
package: their contract is :mod:`disagg.interfaces`."""

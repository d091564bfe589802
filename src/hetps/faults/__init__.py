"""The fault-tolerance wing: the parts that let a job live through deaths and restarts.

Each is a part of a host in the layers above it, takes the port of its host's family
(:mod:`hetps.cluster.ports`, :mod:`hetps.kvstore.ports`), and the composition root
(:mod:`hetps.roles`) plugs it in, so neither ``cluster`` nor ``kvstore`` imports this wing.
docs/FAULTS.md says what a user sees; docs/ARCHITECTURE.md which host each part serves."""

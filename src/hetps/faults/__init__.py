"""The fault-tolerance wing: the parts that let a job live through deaths and restarts.

Each is a part of a host in the layers above it, takes the port of its host's family
(:mod:`hetps.cluster.ports`, :mod:`hetps.kvstore.ports`), and the composition root
(:mod:`hetps.roles`) plugs it in, so neither ``cluster`` nor ``kvstore`` imports this wing:

* the scheduler's (:class:`~hetps.cluster.scheduler.Scheduler`): :mod:`~hetps.faults.takeover`
  (a dead server taken over, a server or a scheduler started again) and
  :mod:`~hetps.faults.elastic` (workers let go and let in again, HETPS_ELASTIC);
* a server's (:class:`~hetps.kvstore.server.KVServer`): :mod:`~hetps.faults.replicas` (copies
  of its keys on other servers, HETPS_REPLICAS) and :mod:`~hetps.faults.elastic_rounds`
  (rounds kept per worker, leaves and joins);
* a node's (:class:`~hetps.cluster.node.Node`, a server's or a worker's):
  :mod:`~hetps.faults.recovery` (failover, rejoin and readmit: a node's side of a death or a
  restart), given by :func:`hetps.roles.new_node` (a worker's through
  :func:`hetps.roles.new_worker_store`);
* a worker's store (:class:`~hetps.kvstore.client.DistKVStore`): :mod:`~hetps.faults.joining`
  (a worker started again joins the running job), given by
  :func:`hetps.roles.new_worker_store`;
* ``hetps train``'s worker (:class:`hetps.app.worker.WorkerRun`): :mod:`~hetps.faults.rejoin`
  (the live workers let a worker started again in, with their state).

docs/FAULTS.md says what a user sees; docs/ARCHITECTURE.md how it fits.
"""

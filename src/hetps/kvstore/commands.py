"""Command names of the KVStore data plane (worker <-> server)."""

INIT = "init"
PUSH = "push"
PULL = "pull"
SET_OPTIMIZER = "set_optimizer"
GET_STATES = "get_states"
SET_STATES = "set_states"
FORECAST = "forecast"  # a tiny message announcing the next data message (link measurement)
PROBE = "probe"  # a probe payload for links that carry no data
PACE = "pace"  # pace the server's connection to this worker at a rate (bytes/s; 0: none)
DROP = "drop"  # forget slices that moved to another server
RECEIPT = "receipt"  # a server got a push (credit for the worker's push window)

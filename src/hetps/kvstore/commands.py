"""Command names of the KVStore data plane (worker <-> server)."""

INIT = "init"
PUSH = "push"
PULL = "pull"
SET_OPTIMIZER = "set_optimizer"
GET_STATES = "get_states"
SET_STATES = "set_states"

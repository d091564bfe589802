"""Link model: Network validation, measured-matrix conversion, load model and predicted times."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hetps.balance import (
    LoadModel,
    Network,
    iteration_time,
    lower_bound,
    server_times,
)

INF = math.inf


def test_network_from_rates_defaults_down_to_up():
    net = Network.from_rates([1.0, 2.0])
    assert net.n_nodes == 2
    np.testing.assert_array_equal(net.down, [1.0, 2.0])
    assert net.link is None


def test_network_is_read_only():
    net = Network.from_rates([1.0, 2.0])
    with pytest.raises(ValueError):
        net.up[0] = 5.0


@pytest.mark.parametrize(
    ("up", "down", "link", "match"),
    [
        ([1.0, -2.0], None, None, r"negative bandwidth up\[1\]"),
        ([1.0, 2.0], [1.0, -1.0], None, r"negative bandwidth down\[1\]"),
        ([1.0, 2.0], None, [[0, -1], [1, 0]], r"negative bandwidth link\[0\]\[1\]"),
        ([1.0, math.nan], None, None, "NaN"),
        ([], None, None, "at least one node"),
        ([1.0, 2.0], [1.0], None, "down has 1"),
        ([1.0, 2.0], None, [[1.0]], "link must be 2x2"),
    ],
)
def test_network_rejects_bad_rates(up, down, link, match):
    with pytest.raises(ValueError, match=match):
        Network.from_rates(up, down, link)


def test_from_matrix_max_mode():
    bw = [[INF, 4.0, 2.0], [1.0, INF, 3.0], [5.0, 6.0, INF]]
    net = Network.from_matrix(bw, node_caps="max")
    np.testing.assert_array_equal(net.up, [4.0, 3.0, 6.0])
    np.testing.assert_array_equal(net.down, [5.0, 6.0, 3.0])
    assert net.link[0, 1] == 4.0 and net.link[2, 0] == 5.0
    assert np.isinf(np.diag(net.link)).all()


def test_from_matrix_sum_and_none_modes():
    bw = [[0.0, 4.0, 2.0], [1.0, 0.0, 3.0], [5.0, 6.0, 0.0]]  # diagonal ignored
    s = Network.from_matrix(bw)  # "sum" is the default
    np.testing.assert_array_equal(s.up, [6.0, 4.0, 11.0])
    np.testing.assert_array_equal(s.down, [6.0, 10.0, 5.0])
    assert s.link is None
    n = Network.from_matrix(bw, node_caps="none")
    assert np.isinf(n.up).all() and np.isinf(n.down).all()
    assert n.link[1, 2] == 3.0


def test_from_matrix_fills_unmeasured_links_with_median():
    bw = [[INF, math.nan, 2.0], [4.0, INF, 6.0], [8.0, 10.0, INF]]
    net = Network.from_matrix(bw, node_caps="max")
    assert net.link[0, 1] == pytest.approx(6.0)  # median of 2, 4, 6, 8, 10
    assert Network.from_matrix(bw).up[0] == pytest.approx(8.0)  # "sum": 6 + 2


def test_from_matrix_errors():
    with pytest.raises(ValueError, match=r"negative bandwidth bw\[1\]\[0\]"):
        Network.from_matrix([[INF, 1.0], [-1.0, INF]])
    with pytest.raises(ValueError, match="no measured"):
        Network.from_matrix([[INF, math.nan], [math.nan, INF]])
    with pytest.raises(ValueError, match="node_caps"):
        Network.from_matrix([[INF, 1.0], [1.0, INF]], node_caps="avg")


def test_load_model_colocated_coefficients():
    # 3 co-located nodes: egress of node i = (M - x_i) + 2 x_i = M + x_i
    model = LoadModel.build(Network.from_rates([1.0, 2.0, 3.0]), 6.0)
    assert model.names == ("send 0", "recv 0", "send 1", "recv 1", "send 2", "recv 2")
    np.testing.assert_array_equal(model.A[0], [1.0, 0.0, 0.0])
    np.testing.assert_array_equal(model.A[5], [0.0, 0.0, 1.0])
    np.testing.assert_array_equal(model.beta, np.ones(6))
    assert model.separable
    f = np.array([0.5, 0.5, 0.0])
    np.testing.assert_allclose(model.loads(f)[::2], [9.0, 9.0, 6.0])
    np.testing.assert_allclose(model.resource_times(f)[::2], [9.0, 4.5, 2.0])


def test_load_model_split_roles_and_links():
    link = np.full((3, 3), INF)
    link[0, 1] = 2.0  # worker 0 -> server 1 push
    link[1, 0] = 4.0  # server 1 -> worker 0 pull
    net = Network(np.full(3, INF), np.array([INF, 10.0, INF]), link)
    model = LoadModel.build(net, 8.0, servers=[1, 2], workers=[0])
    assert model.names == ("recv 1", "link 0->1", "link 1->0")
    np.testing.assert_array_equal(model.A, [[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
    np.testing.assert_array_equal(model.beta, [0.0, 0.0, 0.0])
    np.testing.assert_allclose(model.server_times([0.5, 0.5]), [2.0, 0.0])


def test_colocated_with_links_is_not_separable():
    link = np.full((3, 3), 1.0)
    net = Network(np.full(3, INF), np.full(3, INF), link)
    model = LoadModel.build(net, 1.0)
    assert not model.separable
    # link 0->1 carries the push of server 1's share and the pull of server 0's share
    row = model.names.index("link 0->1")
    np.testing.assert_array_equal(model.A[row], [1.0, 1.0, 0.0])


def test_single_worker_colocated_has_negative_coefficient():
    # one worker on node 0 also hosting a server: node 0 sends only M - x_0
    model = LoadModel.build(Network.from_rates([1.0, 1.0]), 1.0, servers=[0, 1], workers=[0])
    assert model.A[0, 0] == -1.0
    assert not model.separable


def test_iteration_and_server_times():
    net = Network.from_rates([4.0, 5.0, 6.0])
    assert iteration_time(net, [5.0, 5.0, 5.0]) == pytest.approx(5.0)
    np.testing.assert_allclose(server_times(net, [1.0, 5.0, 9.0]), [4.0, 4.0, 4.0])
    np.testing.assert_allclose(server_times(net, [1, 5, 9], unit_bytes=2.0), [8.0, 8.0, 8.0])
    with pytest.raises(ValueError, match="expected 3 shares"):
        iteration_time(net, [1.0, 2.0])
    with pytest.raises(ValueError, match=">= 0"):
        iteration_time(net, [1.0, -2.0, 3.0])


def test_zero_rate_link_costs_infinite_time_when_used():
    link = np.full((2, 2), INF)
    link[0, 1] = 0.0
    net = Network(np.full(2, INF), np.full(2, INF), link)
    assert iteration_time(net, [1.0, 0.0], servers=[0, 1], workers=[0]) == 0.0
    assert iteration_time(net, [0.0, 1.0], servers=[0, 1], workers=[0]) == INF


@pytest.mark.parametrize(
    ("servers", "workers", "match"),
    [
        ([], None, "servers is empty"),
        (None, [], "workers is empty"),
        ([0, 0], None, "twice"),
        ([0, 5], None, "outside"),
    ],
)
def test_roles_validation(servers, workers, match):
    with pytest.raises(ValueError, match=match):
        LoadModel.build(Network.from_rates([1.0, 1.0]), 1.0, servers, workers)


def test_lower_bound_examples():
    # co-located, node caps 4, 5, 6, M = 15: the optimum equalises (M + x_i)/c_i = 4
    assert lower_bound([4, 5, 6], [4, 5, 6], 15) == pytest.approx(4.0)
    # the slowest node's own worker traffic (push M, pull M) bounds everything: M / 1
    assert lower_bound([1, 1, 4], [1, 1, 4], 6) == pytest.approx(6.0)
    # receive caps bind: separate servers 2, 3 each receive x_s from 2 workers
    assert lower_bound([10, 10, 9, 9], [10, 10, 1, 3], 8, [2, 3], [0, 1]) == pytest.approx(4.0)
    # homogeneous co-located n nodes: every node moves 2 (n-1)/n M bytes each way
    assert lower_bound([2.0] * 4, [2.0] * 4, 8.0) == pytest.approx(2 * 3 / 4 * 8 / 2)


def test_lower_bound_infeasible_worker():
    with pytest.raises(ValueError, match="rate 0"):
        lower_bound([0.0, 1.0], [1.0, 1.0], 1.0)

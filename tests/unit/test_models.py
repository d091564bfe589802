"""Models: names, output shapes, exact parameter counts, stable parameter order."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from hetps.app.models import (  # noqa: E402
    count_parameters,
    get_model,
    model_names,
    param_shapes,
)

pytestmark = pytest.mark.torch

# Exact trainable-parameter counts (1 input channel, 10 classes) and numbers of parameter
# tensors. The ESync models have the layer shapes of the MXNet Gluon model zoo that ESync
# trains, so these equal Gluon's counts for the same input channels and classes (e.g.
# resnet18-v1 = torchvision's 11,689,512 - 990 * 513 (classifier) - 2 * 64 * 49 (conv1)).
# A change here changes the traffic every benchmark emulates: update it deliberately.
EXPECTED = {
    "mlp": (269_322, 6),
    "lenet": (61_706, 10),
    "alexnet": (57_029_322, 16),
    "resnet18-v1": (11_175_370, 62),
    "resnet50-v1": (23_541_130, 193),
    "resnet50-v2": (23_514_698, 155),
    "mobilenet-v1": (3_216_650, 83),
    "mobilenet-v2": (2_237_184, 160),
    "inception-v3": (21_805_482, 284),
}


def test_model_names():
    assert model_names() == list(EXPECTED)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_forward_backward_and_counts(name):
    torch.manual_seed(0)
    model = get_model(name)
    x = torch.randn(2, 1, 28, 28)
    out = model(x)
    assert out.shape == (2, 10) and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    out.logsumexp(dim=1).sum().backward()
    params = list(model.parameters())
    assert all(p.grad is not None for p in params)
    count, tensors = EXPECTED[name]
    assert count_parameters(model) == count
    assert len(params) == tensors
    shapes = param_shapes(name)
    assert shapes == [tuple(p.shape) for p in params]
    assert sum(math.prod(s) for s in shapes) == count
    model.eval()
    with torch.no_grad():
        assert model(x[:1]).shape == (1, 10)


@pytest.mark.parametrize("name", ["lenet", "resnet18-v1", "mobilenet-v2"])
def test_deterministic_order_and_init(name):
    torch.manual_seed(7)
    a = get_model(name)
    torch.manual_seed(7)
    b = get_model(name)
    names_a = [n for n, _ in a.named_parameters()]
    assert names_a == [n for n, _ in b.named_parameters()]
    for (_, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert param_shapes(name) == param_shapes(name)


def test_num_classes_and_name_spelling():
    model = get_model("ResNet18_V1", num_classes=3)
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 3)
    assert param_shapes("resnet18-v1", num_classes=3)[-2:] == [(3, 512), (3,)]
    assert count_parameters(get_model("lenet", num_classes=3)) == 61_706 - 7 * 85
    with pytest.raises(ValueError, match="num_classes"):
        get_model("lenet", num_classes=0)


def test_unknown_name_lists_the_choices():
    with pytest.raises(ValueError) as err:
        get_model("vgg16")
    msg = str(err.value)
    assert "'vgg16'" in msg
    assert all(n in msg for n in EXPECTED)
    with pytest.raises(ValueError, match="resnet18-v1"):
        param_shapes("resnet18")


def test_count_parameters_trainable_only():
    model = get_model("mlp")
    model.net[1].weight.requires_grad_(False)
    assert count_parameters(model) == 269_322 - 784 * 256
    assert count_parameters(model, trainable_only=False) == 269_322
    # buffers (BatchNorm running statistics) never count
    resnet = get_model("resnet50-v2")
    assert count_parameters(resnet, trainable_only=False) == 23_514_698

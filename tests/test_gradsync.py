"""The fixed bucket layout (pure): the same for the same model, closed at the caps as DDP's."""

from torch import nn

from trainguard.train.gradsync import MB, plan_buckets


def layout(model, cap=25 * MB, first=1 * MB):
    return [[tuple(p.shape) for p in b.params] for b in plan_buckets(list(model.parameters()), cap, first)]


def mlp(width):
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def test_reverse_order_and_a_big_gradient_closes_its_bucket():
    # 1570 x 1570 floats are 9.9 MB: the first bucket closes with the first of them, the second at the end
    assert layout(mlp(1570)) == [[(10,), (10, 1570), (1570,), (1570, 1570)],
                                 [(1570,), (1570, 1570), (1570,), (1570, 64)]]


def test_the_layout_is_a_function_of_the_parameters_only():
    assert layout(mlp(690)) == layout(mlp(690))
    assert len(layout(mlp(3000))) == 3  # 36 MB gradients: each closes a bucket past the 25 MB cap


def test_dtypes_never_share_a_bucket():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).double())
    assert [len(b) for b in layout(model)] == [2, 2]

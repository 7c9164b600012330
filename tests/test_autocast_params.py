"""Inference under autocast keeps the layers' cast weights across forwards (vtdense.layers.autocast).

Autocast casts every float32 weight and bias of a lower-precision op again in each forward. On a
GPU a bf16 Swin-T forward at batch 64 is paced by its host, and those casts were about 100 of its
331 ATen calls. In inference the copies are kept until the parameters change. Checked on the CPU's
autocast (the code is device-independent): bit-identical outputs, fewer casts, every way a weight
changes seen, nothing kept in training or for parameters that are gone.
"""

from __future__ import annotations

import gc

import pytest
import torch

import vtdense
from vtdense.layers import autocast as A

from op_calls import OpCalls

TINY = {
    "swin_tiny": dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4), window_size=4),
    "swinv2_tiny": dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4), window_size=4),
    "mvitv2_tiny": dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=1),
}


def _model(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return vtdense.create_backbone(name, drop_path_rate=0.0, **TINY[name]).eval()


def _forward(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        return list(model(x).values())


def _uncached(model, x, monkeypatch) -> list[torch.Tensor]:
    with monkeypatch.context() as m:
        m.setattr(A, "_cached", lambda p, dtype: p)
        return _forward(model, x)


def _casts_of_params(model: torch.nn.Module) -> int:
    ids = {id(p) for p in model.parameters()}
    return sum(1 for k in A._casts if k in ids)


@pytest.fixture(autouse=True)
def _empty_cache():
    A.clear_autocast_params()
    yield
    A.clear_autocast_params()


@pytest.mark.parametrize("name", list(TINY))
def test_outputs_are_bit_identical_and_casts_fewer(name, monkeypatch) -> None:
    model = _model(name)
    x = torch.randn(2, 3, 64, 96)
    with OpCalls(torch.ops.aten._to_copy) as plain_casts:
        ref = _uncached(model, x, monkeypatch)
    first = _forward(model, x)  # fills the cache
    assert _casts_of_params(model) > 0
    with OpCalls(torch.ops.aten._to_copy) as kept_casts:
        again = _forward(model, x)
    for a, b, c in zip(ref, first, again):
        assert a.dtype == b.dtype == c.dtype
        assert torch.equal(a, b) and torch.equal(a, c)
    linear_params = sum(1 for mod in model.modules() if isinstance(mod, torch.nn.Linear) for _ in mod.parameters())
    assert plain_casts.count - kept_casts.count >= linear_params * 0.9, (plain_casts.count, kept_casts.count, linear_params)


def test_every_way_a_weight_changes_is_seen(monkeypatch) -> None:
    model = _model("swin_tiny")
    x = torch.randn(1, 3, 64, 64)
    _forward(model, x)
    qkv = model.layers[0].blocks[0].attn.qkv

    with torch.no_grad():  # an in-place update, as an optimizer step or an EMA makes
        qkv.weight.mul_(1.5)
    assert all(torch.equal(a, b) for a, b in zip(_forward(model, x), _uncached(model, x, monkeypatch)))

    other = _model("swin_tiny", seed=1)  # load_state_dict copies in place
    model.load_state_dict(other.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(_forward(model, x), _forward(other, x)))

    qkv.weight.data = qkv.weight.detach() * 0.25  # new storage, as Module.to() gives (no version bump)
    assert all(torch.equal(a, b) for a, b in zip(_forward(model, x), _uncached(model, x, monkeypatch)))

    qkv.weight = torch.nn.Parameter(qkv.weight.detach() * 0.5)  # a new parameter
    assert all(torch.equal(a, b) for a, b in zip(_forward(model, x), _uncached(model, x, monkeypatch)))

    with torch.no_grad():  # an edit through .data bumps no version counter: clear_autocast_params() is the way
        qkv.weight.data.mul_(3.0)
        A.clear_autocast_params()
    assert all(torch.equal(a, b) for a, b in zip(_forward(model, x), _uncached(model, x, monkeypatch)))


def test_a_forward_under_float16_autocast_gets_its_own_copies(monkeypatch) -> None:
    model = _model("swin_tiny")
    x = torch.randn(1, 3, 64, 64)
    _forward(model, x)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        half = list(model(x).values())
        with monkeypatch.context() as m:
            m.setattr(A, "_cached", lambda p, dtype: p)
            ref = list(model(x).values())
    assert all(torch.equal(a, b) for a, b in zip(half, ref))


def test_training_keeps_nothing_and_drops_what_validation_kept() -> None:
    model = _model("swin_tiny")
    x = torch.randn(1, 3, 64, 64)
    _forward(model, x)
    assert _casts_of_params(model) > 0
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    sum(o.float().sum() for o in out.values()).backward()
    assert _casts_of_params(model) == 0
    assert model.layers[0].blocks[0].attn.qkv.weight.grad is not None


def test_nothing_kept_without_autocast_for_inference_tensors_or_after_the_model_goes() -> None:
    model = _model("swin_tiny")
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        model(x)  # float32, no autocast
    assert _casts_of_params(model) == 0

    with torch.inference_mode():
        frozen = _model("swin_tiny")  # parameters made under inference_mode have no version counter
        with torch.autocast("cpu", dtype=torch.bfloat16):
            frozen(x)
    assert _casts_of_params(frozen) == 0

    _forward(model, x)
    assert len(A._casts) > 0
    del model
    gc.collect()
    assert len(A._casts) == 0


def test_torch_func_transforms_keep_nothing() -> None:
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(3, 5, 8)
    from vtdense.layers.cpu_linear import apply_linear

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.func.vmap(lambda r: apply_linear(lin, r))(x)
        assert len(A._casts) == 0
        ref = torch.func.vmap(lambda r: torch.nn.functional.linear(r, lin.weight, lin.bias))(x)
    assert torch.equal(out, ref)


def test_views_into_a_flat_buffer_are_not_kept() -> None:
    """FSDP's parameters are views into flat buffers that collectives refill without bumping a
    version counter: a kept copy could go stale unseen, so none is kept."""
    lin = torch.nn.Linear(8, 4)
    flat = torch.zeros(4 * 8 + 4)
    lin.weight = torch.nn.Parameter(flat[:32].view(4, 8))
    lin.bias = torch.nn.Parameter(flat[32:])
    x = torch.randn(2, 8)
    from vtdense.layers.cpu_linear import apply_linear

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        apply_linear(lin, x)
        assert len(A._casts) == 0
        flat.data.copy_(torch.randn(36))  # as a collective writes: no version bump seen by the views
        assert torch.equal(apply_linear(lin, x), torch.nn.functional.linear(x, lin.weight, lin.bias))


def test_the_copies_can_be_switched_off(monkeypatch) -> None:
    model = _model("swin_tiny")
    x = torch.randn(1, 3, 64, 64)
    ref = _uncached(model, x, monkeypatch)
    _forward(model, x)
    assert len(A._casts) > 0
    try:
        A.set_autocast_params_kept(False)
        assert len(A._casts) == 0
        out = _forward(model, x)
        assert len(A._casts) == 0
    finally:
        A.set_autocast_params_kept(True)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


def test_a_parameter_freed_inside_the_locked_section_does_not_deadlock() -> None:
    """A weak reference's callback runs whenever the garbage collector frees a parameter, which an
    allocation inside the cache's locked section can trigger: the lock must be reentrant."""
    import threading

    def locked_callback() -> None:
        with A._lock:
            A._forget(12345, None)  # what the callback does, while this thread holds the lock

    t = threading.Thread(target=locked_callback, daemon=True)
    t.start()
    t.join(timeout=10)
    assert not t.is_alive()

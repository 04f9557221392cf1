"""The parametrize quirk (quirks/parametrize.py): modules with ``torch.nn.utils.parametrize`` parametrizations
(``weight_norm``, ``spectral_norm``, ``orthogonal``, custom ones with and without ``right_inverse``, stacked, on
a buffer) and a tiny transformers ``Wav2Vec2Model`` (its weight-normed positional convolution) dumped and loaded,
trusted and restricted, and through the model cache; the safe globals under hostile arguments. Nothing is
downloaded.

``sample`` is the conformance suite's factory (``tests.test_quirk_parametrize:sample``): importable from the
repository root in a fresh interpreter, and deterministic.
"""

from __future__ import annotations

import collections
import copy
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations as P
from torch.nn.utils import parametrize
from zerocopy_pickle_quirks import parametrize as quirk

import zerocopy_pickle as zp
from zerocopy_pickle import validate
from zerocopy_pickle.testing import ReducerConformance

from .conftest import REPO, region_of
from .hostile_streams import naming

LINEAR = ("torch.nn.modules.linear", "Linear")


# -- parametrizations of a user's (importable: they pickle by reference) -------------------------------------------


class Symmetric(nn.Module):
    """``X -> triu(X) + triu(X, 1).T``, with a ``right_inverse`` that counts its calls (never at load)."""

    inverse_calls = 0

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return X.triu() + X.triu(1).transpose(-1, -2)

    def right_inverse(self, A: torch.Tensor) -> torch.Tensor:
        Symmetric.inverse_calls += 1
        return A.triu()


class RankOne(nn.Module):
    """A ``right_inverse`` that returns a tuple: the originals are ``original0`` and ``original1``."""

    inverse_calls = 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(-1) @ y.unsqueeze(-2)

    def right_inverse(self, Z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        RankOne.inverse_calls += 1
        U, S, Vh = torch.linalg.svd(Z, full_matrices=False)
        s0_sqrt = S[0].sqrt().unsqueeze(-1)
        return U[..., :, 0] * s0_sqrt, Vh[..., 0, :] * s0_sqrt


class Scale(nn.Module):
    """A parametrization with state of its own (a buffer), no ``right_inverse``."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.register_buffer("factor", torch.tensor(factor))

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return X * self.factor


class WithBuffer(nn.Module):
    """A module whose parametrized tensor is a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.randn(3, 3))
        self.linear = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) @ self.table


class NewingModule(nn.Module):
    """A module class with a ``__new__`` of its own: the rebuild refuses to fill what it returns."""

    def __new__(cls, *args: Any, **kwargs: Any) -> NewingModule:
        return super().__new__(cls)


class TaggedTensor(torch.Tensor):
    """A tensor subclass: its __torch_function__ would run on every operation."""


class NotAModule:
    """A class a caller may allow that is no module."""


def discriminator() -> nn.Module:
    """A small GAN discriminator: Conv2d layers and a Linear head, all spectral-normed."""
    return nn.Sequential(
        P.spectral_norm(nn.Conv2d(3, 8, 3, stride=2, padding=1)),
        nn.LeakyReLU(0.2),
        P.spectral_norm(nn.Conv2d(8, 16, 3, stride=2, padding=1), n_power_iterations=2),
        nn.LeakyReLU(0.2),
        nn.Flatten(),
        P.spectral_norm(nn.Linear(16 * 4 * 4, 1)),
    )


DISCRIMINATOR_CLASSES = [nn.Sequential, nn.Conv2d, nn.LeakyReLU, nn.Flatten, nn.Linear]


def sample() -> dict[str, Any]:
    """The conformance suite's objects: ``ParametrizationList``s of torch's own parametrizations, which a restricted
    load rebuilds with no ``allow=`` at all (a parametrized module's class always needs one)."""
    torch.manual_seed(0)
    return {
        "weight_norm": P.weight_norm(nn.Linear(4, 3)).parametrizations.weight,
        "spectral_norm": P.spectral_norm(nn.Linear(4, 3), n_power_iterations=3).parametrizations.weight,
        "spectral_norm_1d": P.spectral_norm(nn.Linear(4, 3), "bias").parametrizations.bias,
        "stacked": P.spectral_norm(P.weight_norm(nn.Linear(3, 3))).parametrizations.weight,
        "orthogonal": P.orthogonal(nn.Linear(4, 4)).parametrizations.weight,  # holds an Enum member
    }


class TestParametrizeConformance(ReducerConformance):
    plugin = "parametrize"
    factory = "tests.test_quirk_parametrize:sample"

    def env(self) -> dict[str, str]:
        return {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


# -- helpers -------------------------------------------------------------------------------------------------------


def assert_in_snapshot(tensor: torch.Tensor, path: Path) -> None:
    """The tensor's memory lies inside this process's mapping of the snapshot file: zero-copy."""
    region = region_of(tensor.untyped_storage().data_ptr())
    assert region is not None and region[2] == os.path.realpath(path), f"not in the snapshot's mapping: {region}"


def dump_path(obj: Any, tmp_path: Path, name: str = "m.zcp") -> Path:
    path = tmp_path / name
    zp.dump(obj, path)
    return path


def restricted_load(path: Path, expected_needed: set[tuple[str, str]] | None = None) -> Any:
    """A restricted load, refused first; then loaded with exactly the ``allow=`` the refusal suggests (its text and
    its ``allow`` attribute), which must name no function of this quirk: its safe globals need no ``allow=``."""
    with pytest.raises(zp.RestrictedLoadError) as refused:
        zp.load(path)
    error = refused.value
    needed = set(error.needed)
    if expected_needed is not None:
        assert needed == expected_needed
    assert not any(module.startswith("zerocopy_pickle_quirks") for module, _ in needed)
    assert error.allow is not None and not error.trusted_only
    assert set(error.allow) == {f"{module}:{name}" for module, name in needed}
    assert f"allow={list(error.allow)!r}" in str(error)
    return zp.load(path, allow=error.allow)


def originals(module: nn.Module, name: str = "weight") -> list[torch.Tensor]:
    plist = module.parametrizations[name]
    return [getattr(plist, f"original{i}" if not plist.is_tensor else "original") for i in range(plist.ntensors)]


def assert_parametrized_like(expected: nn.Module, loaded: nn.Module, names: tuple[str, ...] = ("weight",)) -> None:
    """Same original class, a generated class of torch's own, the same parametrizations, originals and values."""
    assert parametrize.type_before_parametrizations(loaded) is parametrize.type_before_parametrizations(expected)
    assert type(loaded) is not type(expected) and type(loaded).__name__ == type(expected).__name__
    assert type(loaded).__module__ == "torch.nn.utils.parametrize"
    for name in names:
        assert parametrize.is_parametrized(loaded, name)
        before, after = expected.parametrizations[name], loaded.parametrizations[name]
        assert type(after) is parametrize.ParametrizationList
        assert (after.is_tensor, after.ntensors, after.unsafe) == (before.is_tensor, before.ntensors, before.unsafe)
        assert [type(m) for m in after] == [type(m) for m in before]
        for a, b in zip(originals(expected, name), originals(loaded, name), strict=True):
            assert type(a) is type(b) and a.requires_grad == b.requires_grad and torch.equal(a, b)
        assert torch.equal(getattr(expected, name), getattr(loaded, name))
    assert list(expected.state_dict()) == list(loaded.state_dict())
    for key, value in expected.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key


# -- torch's parametrizations ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: P.weight_norm(nn.Linear(5, 4)),
        lambda: P.weight_norm(nn.Linear(5, 4), dim=None),
        lambda: P.spectral_norm(nn.Linear(5, 4)),
        lambda: P.orthogonal(nn.Linear(4, 4)),
        lambda: P.orthogonal(nn.Linear(5, 3), orthogonal_map="cayley"),
        lambda: P.orthogonal(nn.Linear(5, 3), orthogonal_map="householder"),
        lambda: P.orthogonal(nn.Linear(4, 4), use_trivialization=False),
    ],
    ids=["weight_norm", "weight_norm_dim_none", "spectral_norm", "orthogonal", "cayley", "householder", "no_base"],
)
def test_builtin_parametrizations_round_trip(tmp_path: Path, make: Callable[[], nn.Module]) -> None:
    torch.manual_seed(0)
    module = make().eval()
    x = torch.randn(2, module.in_features)
    path = dump_path(module, tmp_path)
    assert [p.name for p in zp.read_header(path).plugins] == ["parametrize"]
    trusted = zp.load(path, trusted=True)
    # Restricted: the refusal names exactly the original class (torch's parametrizations travel by name).
    restricted = restricted_load(path, {LINEAR})
    for loaded in (trusted, restricted):
        assert_parametrized_like(module, loaded)
        assert torch.equal(module(x), loaded(x))
        for tensor in originals(loaded):
            assert_in_snapshot(tensor, path)
    for name, value in module.parametrizations.weight[0].named_buffers():
        assert torch.equal(value, dict(restricted.parametrizations.weight[0].named_buffers())[name])


def test_spectral_norm_discriminator_bit_for_bit_in_train_mode(tmp_path: Path) -> None:
    torch.manual_seed(0)
    disc = discriminator()
    images = torch.randn(4, 3, 16, 16)
    disc.train()
    for _ in range(3):  # the power iteration updates _u and _v in place on every training forward
        disc(images)
    u_before = disc[0].parametrizations.weight[0]._u.clone()
    path = dump_path(disc, tmp_path)
    loaded = restricted_load(path, {(c.__module__, c.__qualname__) for c in DISCRIMINATOR_CLASSES})
    assert loaded.training and loaded[0].parametrizations.weight[0].training
    spectral = loaded[2].parametrizations.weight[0]
    assert spectral.n_power_iterations == 2 and spectral.dim == 0 and spectral.eps == 1e-12
    assert_in_snapshot(loaded[0].parametrizations.weight[0]._u, path)
    for _ in range(2):
        assert torch.equal(disc(images), loaded(images))  # train mode: both update _u the same way
    assert not torch.equal(loaded[0].parametrizations.weight[0]._u, u_before)
    for (name, a), (_, b) in zip(disc.named_buffers(), loaded.named_buffers(), strict=True):
        assert torch.equal(a, b), name
    disc.eval(), loaded.eval()
    assert torch.equal(disc(images), loaded(images))
    # The snapshot itself is unchanged by the loaded copy's in-place updates: a second load sees the dumped _u.
    assert torch.equal(zp.load(path, trusted=True)[0].parametrizations.weight[0]._u, u_before)


def test_right_inverse_is_not_run_at_load_and_tuple_originals(tmp_path: Path) -> None:
    torch.manual_seed(0)
    sym = parametrize.register_parametrization(nn.Linear(3, 3), "weight", Symmetric())
    rank = parametrize.register_parametrization(nn.Linear(4, 4), "weight", RankOne())
    with torch.no_grad():  # originals that right_inverse would change: a load that ran it would differ
        sym.parametrizations.weight.original.add_(torch.tril(torch.ones(3, 3), -1))
        rank.parametrizations.weight.original0.mul_(3.0)
    assert rank.parametrizations.weight.ntensors == 2 and not rank.parametrizations.weight.is_tensor
    path = dump_path({"sym": sym, "rank": rank}, tmp_path)
    calls = Symmetric.inverse_calls, RankOne.inverse_calls
    loaded = restricted_load(path, {LINEAR, *((c.__module__, c.__qualname__) for c in (Symmetric, RankOne))})
    trusted = zp.load(path, trusted=True)
    assert (Symmetric.inverse_calls, RankOne.inverse_calls) == calls
    for result in (loaded, trusted):
        assert_parametrized_like(sym, result["sym"])
        assert_parametrized_like(rank, result["rank"])
        assert torch.equal(result["sym"].parametrizations.weight.original, sym.parametrizations.weight.original)
        assert torch.equal(result["rank"].parametrizations.weight.original0, rank.parametrizations.weight.original0)
    # Assignment goes through right_inverse on the loaded module, as on the original.
    target = torch.randn(4, 4)
    target = target + target.T
    sym2 = parametrize.register_parametrization(nn.Linear(4, 4), "weight", Symmetric())
    loaded_sym2 = zp.loads(zp.dumps(sym2), trusted=True)
    before = Symmetric.inverse_calls
    sym2.weight = target
    loaded_sym2.weight = target
    assert Symmetric.inverse_calls == before + 2
    assert torch.equal(sym2.weight, loaded_sym2.weight) and torch.allclose(loaded_sym2.weight, target)


def test_stacked_parametrizations_keep_their_order(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = nn.Linear(3, 3)
    parametrize.register_parametrization(module, "weight", Symmetric())
    parametrize.register_parametrization(module, "weight", Scale(2.5))
    parametrize.register_parametrization(module, "bias", Scale(-1.0))
    path = dump_path(module, tmp_path)
    loaded = restricted_load(path, {LINEAR, *((c.__module__, c.__qualname__) for c in (Symmetric, Scale))})
    assert [type(m) for m in loaded.parametrizations.weight] == [Symmetric, Scale]
    assert list(loaded.parametrizations) == ["weight", "bias"]
    assert_parametrized_like(module, loaded, ("weight", "bias"))
    assert float(loaded.parametrizations.weight[1].factor) == 2.5
    x = torch.randn(2, 3)
    assert torch.equal(module(x), loaded(x))


def test_parametrization_on_a_buffer(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = WithBuffer()
    parametrize.register_parametrization(module, "table", Symmetric())
    path = dump_path(module, tmp_path)
    loaded = restricted_load(path, {(WithBuffer.__module__, "WithBuffer"), (Symmetric.__module__, "Symmetric"), LINEAR})
    plist = loaded.parametrizations.table
    assert "original" in plist._buffers and "original" not in plist._parameters
    assert type(plist.original) is torch.Tensor and not plist.original.requires_grad
    assert_parametrized_like(module, loaded, ("table",))
    assert_in_snapshot(plist.original, path)
    x = torch.randn(2, 3)
    assert torch.equal(module(x), loaded(x))


def test_generated_class_behaviour(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = P.weight_norm(nn.Linear(4, 3))
    loaded = zp.load(dump_path(module, tmp_path), allow=[nn.Linear])
    assert parametrize.is_parametrized(loaded) and parametrize.is_parametrized(loaded, "weight")
    assert not parametrize.is_parametrized(loaded, "bias")
    assert "weight" not in loaded._parameters and isinstance(vars(type(loaded))["weight"], property)
    # Each load gets its own generated class, as each register_parametrization does.
    again = zp.load(tmp_path / "m.zcp", trusted=True)
    assert type(again) is not type(loaded) and type(again).__bases__ == (nn.Linear,)
    with parametrize.cached():
        assert loaded.weight is loaded.weight  # computed once while cached
    assert loaded.weight is not loaded.weight
    copied = copy.deepcopy(loaded)
    assert torch.equal(copied.weight, module.weight) and parametrize.is_parametrized(copied)
    # remove_parametrizations, both ways, gives back the original class with what the original would keep.
    # (Fresh objects each time: a deepcopy shares torch's generated class, whose property removal deletes.)
    kept = parametrize.remove_parametrizations(zp.load(tmp_path / "m.zcp", trusted=True), "weight")
    assert type(kept) is nn.Linear and type(kept.weight) is nn.Parameter
    expected = parametrize.remove_parametrizations(zp.loads(zp.dumps(module), trusted=True), "weight")
    assert torch.equal(kept.weight, expected.weight)
    spectral = P.spectral_norm(nn.Linear(4, 3))
    data = zp.dumps(spectral)
    for leave in (True, False):
        reference = P.spectral_norm(nn.Linear(4, 3))
        reference.load_state_dict(spectral.state_dict())
        a = parametrize.remove_parametrizations(reference, "weight", leave_parametrized=leave)
        b = parametrize.remove_parametrizations(zp.loads(data, allow=[nn.Linear]), "weight", leave_parametrized=leave)
        assert type(b) is nn.Linear and torch.equal(a.weight, b.weight)
    loaded_spectral = zp.loads(data, allow=[nn.Linear])
    original = loaded_spectral.parametrizations.weight.original
    assert parametrize.remove_parametrizations(loaded_spectral, "weight", leave_parametrized=False).weight is original
    # weight_norm's load_state_dict compatibility hook (old weight_g / weight_v keys) is rebuilt.
    old_style = {"weight_g": module.parametrizations.weight.original0 * 2, "weight_v": module.weight.detach(),
                 "bias": module.bias.detach()}  # fmt: skip
    loaded.load_state_dict(old_style)
    module.load_state_dict(old_style)
    assert torch.equal(loaded.weight, module.weight)
    # A loaded module dumps again (the rebuilt compatibility hook is recognised too).
    twice = zp.loads(zp.dumps(loaded), allow=[nn.Linear])
    assert torch.equal(twice.weight, loaded.weight) and len(twice._load_state_dict_pre_hooks) == 1


def test_parameter_identity_and_sharing(tmp_path: Path) -> None:
    torch.manual_seed(0)
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    second.weight = first.weight  # tied before parametrizing: the original is the same Parameter
    P.orthogonal(first)
    original = first.parametrizations.weight.original
    assert second.weight is original
    graph = {"first": first, "second": second, "again": first, "original": original}
    path = dump_path(graph, tmp_path)
    for loaded in (zp.load(path, allow=[nn.Linear]), zp.load(path, trusted=True)):
        plist = loaded["first"].parametrizations.weight
        assert loaded["again"] is loaded["first"]
        assert loaded["second"].weight is plist.original is loaded["original"]
        assert type(plist.original) is nn.Parameter and plist.original.requires_grad
    frozen = P.weight_norm(nn.Linear(3, 3))
    frozen.parametrizations.weight.original1.requires_grad_(False)
    loaded = zp.loads(zp.dumps(frozen), allow=[nn.Linear])
    assert [t.requires_grad for t in originals(loaded)] == [True, False]


def test_training_step_matches(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(P.weight_norm(nn.Linear(6, 5)), nn.Tanh(), P.spectral_norm(nn.Linear(5, 2)))
    loaded = zp.load(dump_path(model, tmp_path), allow=[nn.Sequential, nn.Linear, nn.Tanh])
    x, y = torch.randn(8, 6), torch.randn(8, 2)
    for net in (model, loaded):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        nn.functional.mse_loss(net(x), y).backward()
        optimizer.step()
    for (name, a), (_, b) in zip(model.named_parameters(), loaded.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(model(x), loaded(x))


# -- dump-time limits ------------------------------------------------------------------------------------------------


def test_what_the_quirk_cannot_carry_is_refused_or_pickled_as_usual() -> None:
    module = P.weight_norm(nn.Linear(3, 3))
    type(module).note = "set on the generated class"
    with pytest.raises(zp.DumpError, match="attributes torch does not put there"):
        zp.dumps(module)
    hooked = P.weight_norm(nn.Linear(3, 3))
    hooked.parametrizations.register_forward_hook(lambda *args: None)
    with pytest.raises(zp.DumpError, match="parametrizations ModuleDict"):
        zp.dumps(hooked)
    # A hook on a ParametrizationList: it travels as the ordinary module it is (trusted, or allow= its class).
    listed = P.weight_norm(nn.Linear(3, 3))
    listed.parametrizations.weight.register_forward_pre_hook(print)
    data = zp.dumps(listed)
    with pytest.raises(zp.RestrictedLoadError) as refused:
        zp.loads(data, allow=[nn.Linear])
    assert ("torch.nn.utils.parametrize", "ParametrizationList") in refused.value.needed
    loaded = zp.loads(data, trusted=True)
    assert torch.equal(loaded.weight, listed.weight) and loaded.parametrizations.weight._forward_pre_hooks
    # One of torch's parametrizations with a field its rebuild would refuse travels as an ordinary module too.
    spectral = P.spectral_norm(nn.Linear(3, 3))
    spectral.parametrizations.weight[0].n_power_iterations = quirk.MAX_POWER_ITERATIONS + 1
    data = zp.dumps(spectral)
    with pytest.raises(zp.RestrictedLoadError) as refused:
        zp.loads(data, allow=[nn.Linear])
    assert ("torch.nn.utils.parametrizations", "_SpectralNorm") in refused.value.needed
    assert zp.loads(data, trusted=True).parametrizations.weight[0].n_power_iterations == quirk.MAX_POWER_ITERATIONS + 1


# -- transformers Wav2Vec2 -------------------------------------------------------------------------------------------


def wav2vec2_config() -> Any:
    from transformers import Wav2Vec2Config

    return Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
        conv_kernel=(10, 3), conv_stride=(5, 2), num_feat_extract_layers=2, num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2, vocab_size=10, hidden_act="relu", feat_extract_activation="relu",
    )  # fmt: skip


@pytest.fixture(scope="module")
def wav2vec2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.Wav2Vec2Model(wav2vec2_config()).eval()


def test_wav2vec2_round_trip(tmp_path: Path, wav2vec2: nn.Module) -> None:
    conv = wav2vec2.encoder.pos_conv_embed.conv
    assert parametrize.is_parametrized(conv, "weight")
    audio = torch.randn(2, 800)
    with torch.no_grad():
        expected = wav2vec2(audio).last_hidden_state
    path = dump_path(wav2vec2, tmp_path)
    restricted = restricted_load(path)
    trusted = zp.load(path, trusted=True)
    for loaded in (restricted, trusted):
        assert_parametrized_like(conv, loaded.encoder.pos_conv_embed.conv)
        assert loaded.encoder.pos_conv_embed.conv.parametrizations._is_hf_initialized is True
        for tensor in originals(loaded.encoder.pos_conv_embed.conv):
            assert_in_snapshot(tensor, path)
        with torch.no_grad():
            assert torch.equal(loaded(audio).last_hidden_state, expected)
    # Training still works: one optimizer step on the loaded model gives the original's parameters.
    reference = copy.deepcopy(wav2vec2).train()
    trusted.train()
    torch.manual_seed(1)
    target = torch.randn_like(expected)
    for net in (reference, trusted):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
        torch.manual_seed(2)  # the same dropout masks
        numpy.random.seed(2)  # and the same SpecAugment time masks (transformers draws them with numpy)
        nn.functional.mse_loss(net(audio).last_hidden_state, target).backward()
        optimizer.step()
    for (name, a), (_, b) in zip(reference.named_parameters(), trusted.named_parameters(), strict=True):
        assert torch.equal(a, b), name


WAV2VEC2_CLIENT = """
import json, sys, warnings
warnings.simplefilter("always")
import torch
if sys.argv[2] == "cache":
    from zerocopy_pickle import cache
    cache.patch_all(autostart=False)
from torch.nn.utils import parametrize
from transformers import Wav2Vec2Model
model = Wav2Vec2Model.from_pretrained(sys.argv[1]).eval()
torch.manual_seed(0)
with torch.no_grad():
    out = model(torch.randn(1, 800)).last_hidden_state
print(json.dumps({"values": [v.hex() for v in out.double().flatten().tolist()],
                  "parametrized": parametrize.is_parametrized(model.encoder.pos_conv_embed.conv, "weight"),
                  "class": type(model.encoder.pos_conv_embed.conv).__name__}))
"""


@pytest.mark.slow
def test_wav2vec2_through_the_model_cache(tmp_path: Path, wav2vec2: nn.Module) -> None:
    from .cache_helpers import run_client, running_server

    wav2vec2.save_pretrained(tmp_path / "wav2vec2")
    model_dir = str(tmp_path / "wav2vec2")
    with running_server() as server:
        miss = run_client(server, WAV2VEC2_CLIENT, model_dir, "cache")
        hit = run_client(server, WAV2VEC2_CLIENT, model_dir, "cache")
        status = server.status()
        plain = run_client(server, WAV2VEC2_CLIENT, model_dir, "plain")
    assert status["misses"] == 1 and status["hits"] == 1, status
    assert status["entries"][0]["call"].startswith("Wav2Vec2Model.from_pretrained")
    for result in (miss, hit):
        assert result["parametrized"] and result["class"] == "ParametrizedConv1d"
        assert result["values"] == plain["values"]


# -- hostile arguments -----------------------------------------------------------------------------------------------


class Reduce:
    """Pickles as ``func(*args)``: how a hostile stream calls a safe global with arguments of its choosing."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.func, self.args


def _restricted(obj: Any, **kwargs: Any) -> Any:
    return zp.loads(naming(zp.dumps(obj), "parametrize"), **kwargs)


def _state(module: nn.Module) -> tuple[Any, ...]:
    """The state tuple the reducer writes for ``module`` (fields, names, lists, training, pre-hooks, extra)."""
    reduced = quirk.reduce_parametrized_module(module)
    state: tuple[Any, ...] = reduced[2]
    return state


def _with(state: tuple[Any, ...], index: int, value: Any) -> tuple[Any, ...]:
    return (*state[:index], value, *state[index + 1 :])


def test_rebuild_module_refuses_what_is_not_a_module_class() -> None:
    for cls in (None, 3, "torch.nn.Linear", len, nn.Linear(2, 2), dict, collections.OrderedDict, NewingModule,
                parametrize.ParametrizationList, type(P.weight_norm(nn.Linear(2, 2)))):  # fmt: skip
        with pytest.raises(zp.UnsafeArgumentError):
            quirk.rebuild_parametrized_module(cls)
    # Through restricted streams: a class the caller allowed is still checked against nn.Module.
    with pytest.raises(zp.SnapshotError, match="not an nn.Module"):
        _restricted(Reduce(quirk.rebuild_parametrized_module, NotAModule), allow=[NotAModule])
    with pytest.raises(zp.SnapshotError, match="defines __new__"):
        _restricted(Reduce(quirk.rebuild_parametrized_module, NewingModule), allow=[NewingModule])
    with pytest.raises(zp.RestrictedLoadError, match="not on this load's allow-list"):
        _restricted(Reduce(quirk.rebuild_parametrized_module, nn.Linear))  # the class itself needs allow=


def test_module_state_is_checked_before_anything_is_set() -> None:
    torch.manual_seed(0)
    good = _state(P.weight_norm(nn.Linear(3, 3)))
    fields, names, plists, training, compat, extra = good
    plist = plists[0]
    other = P.weight_norm(nn.Linear(3, 3)).parametrizations.weight

    unhooked = _with(good, 4, ())  # without the weight_norm pre-hook, which names 'weight'

    def fields_with(**changes: Any) -> dict[str, Any]:
        return {**fields, **changes}

    bad: dict[str, tuple[Any, ...]] = {
        "not a tuple": [fields, names, plists, training, compat, extra],  # type: ignore[dict-item]
        "short": good[:5],
        "long name": _with(good, 1, ("w" * (quirk.MAX_NAME + 1),)),
        "not an identifier": _with(good, 1, ("weight.x",)),
        "dunder": _with(good, 1, ("__class__",)),
        "the dict's own name": _with(good, 1, ("parametrizations",)),
        "a str subclass": _with(good, 1, (type("S", (str,), {})("weight"),)),
        "names as a list": _with(good, 1, ["weight"]),
        "no names": _with(_with(good, 1, ()), 2, ()),
        "duplicate names": _with(_with(good, 1, ("weight", "weight")), 2, (plist, other)),
        "fewer lists than names": _with(good, 1, ("weight", "bias")),
        "one list twice": _with(_with(good, 1, ("weight", "other")), 2, (plist, plist)),
        "a module for a list": _with(good, 2, (nn.ModuleList([Symmetric()]),)),
        "shadows the class": _with(unhooked, 1, ("forward",)),
        "is a parameter too": _with(unhooked, 1, ("bias",)),
        "is an attribute too": _with(unhooked, 1, ("in_features",)),
        "no placeholder": _with(good, 0, fields_with(_modules={})),
        "a module in the placeholder": _with(good, 0, fields_with(_modules={"parametrizations": nn.Linear(1, 1)})),
        "tables not dicts": _with(good, 0, fields_with(_parameters=[("bias", None)])),
        "parametrizations attribute": _with(good, 0, fields_with(parametrizations=None)),
        "non-str key": _with(good, 0, {**fields, 3: None}),
        "training not bool": _with(good, 3, 1),
        "pre-hook for another name": _with(good, 4, ((compat[0][0], "bias"),)),
        "pre-hook key not a placeholder": _with(good, 4, ((compat[0][0] + 1000, "weight"),)),
        "pre-hook key negative": _with(good, 4, ((-1, "weight"),)),
        "extra shadowing": _with(good, 5, {"forward": None}),
        "extra reserved": _with(good, 5, {"_modules": {}}),
    }
    for label, state in bad.items():
        module = quirk.rebuild_parametrized_module(nn.Linear)
        with pytest.raises(zp.UnsafeArgumentError):
            quirk.set_parametrized_state(module, state)
        assert vars(module) == {} and type(module) is nn.Linear, label  # nothing was set
    # A list whose counts disagree with its originals (is_tensor with two, ntensors past what it holds).
    for change in ({"is_tensor": True}, {"ntensors": 3}, {"ntensors": 0}, {"ntensors": True}):
        broken = copy.deepcopy(plist)
        vars(broken).update(change)
        with pytest.raises(zp.UnsafeArgumentError, match="ParametrizationList|originals"):
            quirk.set_parametrized_state(quirk.rebuild_parametrized_module(nn.Linear), _with(good, 2, (broken,)))
    keyed = copy.deepcopy(plist)
    keyed._parameters[3] = nn.Parameter(torch.zeros(1))  # type: ignore[index]
    with pytest.raises(zp.UnsafeArgumentError, match="keys must be str"):
        quirk.set_parametrized_state(quirk.rebuild_parametrized_module(nn.Linear), _with(good, 2, (keyed,)))
    hooks = collections.OrderedDict(fields["_load_state_dict_pre_hooks"])
    hooks["0"] = None
    with pytest.raises(zp.UnsafeArgumentError, match="keyed by int"):
        quirk.set_parametrized_state(
            quirk.rebuild_parametrized_module(nn.Linear), _with(good, 0, fields_with(_load_state_dict_pre_hooks=hooks))
        )
    emptied = copy.deepcopy(plist)
    del emptied._modules["0"]
    with pytest.raises(zp.UnsafeArgumentError, match="parametrizations named"):
        quirk.set_parametrized_state(quirk.rebuild_parametrized_module(nn.Linear), _with(good, 2, (emptied,)))
    # A module filled already, or not a module, is refused.
    with pytest.raises(zp.UnsafeArgumentError, match="empty"):
        quirk.set_parametrized_state(nn.Linear(3, 3), good)
    with pytest.raises(zp.UnsafeArgumentError, match="expected a module"):
        quirk.set_parametrized_state({}, good)
    # The good state does fill it.
    module = quirk.rebuild_parametrized_module(nn.Linear)
    quirk.set_parametrized_state(module, good)
    assert parametrize.is_parametrized(module, "weight")


def test_hostile_module_states_through_restricted_streams() -> None:
    torch.manual_seed(0)
    good = _state(P.weight_norm(nn.Linear(3, 3)))
    for state, match in [
        (_with(_with(good, 1, ("forward",)), 4, ()), "shadow"),
        (_with(good, 1, ("forward",)), "not a parametrized tensor"),
        (_with(good, 1, ("x" * 1000,)), "characters long"),
        (_with(good, 2, (Reduce(quirk.rebuild_builtin_parametrization, "_WeightNorm", True, {"dim": 0}, {}, {}),)),
         "must be a ParametrizationList"),
    ]:  # fmt: skip
        with pytest.raises(zp.SnapshotError, match=match):
            _restricted(Reduce(quirk.set_parametrized_state, Reduce(quirk.rebuild_parametrized_module, nn.Linear),
                               state), allow=[nn.Linear])  # fmt: skip


def test_rebuild_list_refuses_mismatched_and_foreign_arguments() -> None:
    weight = nn.Parameter(torch.randn(3, 3))
    norm = P.weight_norm(nn.Linear(3, 3)).parametrizations.weight[0]
    good = ([norm], (weight, weight), False, False, True, {})
    assert quirk.rebuild_parametrization_list(*good).ntensors == 2
    bad = [
        ([], (weight,), True, False, True, {}),  # no parametrization
        ([norm] * (quirk.MAX_CHAIN + 1), (weight,), True, False, True, {}),
        ((norm,), (weight,), True, False, True, {}),  # a tuple of modules
        ([norm, "x"], (weight,), True, False, True, {}),
        ([nn.Linear], (weight,), True, False, True, {}),  # a class, not a module
        ([norm], [weight], True, False, True, {}),  # a list of originals
        ([norm], (), False, False, True, {}),
        ([norm], (weight,) * (quirk.MAX_CHAIN + 1), False, False, True, {}),
        ([norm], (weight, weight), True, False, True, {}),  # is_tensor with two originals
        ([norm], (weight.detach().numpy(),), True, False, True, {}),
        ([norm], (torch.zeros(2).as_subclass(TaggedTensor),), True, False, True, {}),  # a tensor subclass
        ([norm], (weight,), 1, False, True, {}),
        ([norm], (weight,), True, None, True, {}),
        ([norm], (weight,), True, False, "yes", {}),
        ([norm], (weight,), True, False, True, {"original": None}),  # extra that replaces an original
        ([norm], (weight,), True, False, True, {"forward": None}),
        ([norm], (weight,), True, False, True, []),
    ]
    for args in bad:
        with pytest.raises(zp.UnsafeArgumentError):
            quirk.rebuild_parametrization_list(*args)  # type: ignore[arg-type]
    with pytest.raises(zp.SnapshotError, match="is_tensor=True"):
        _restricted(Reduce(quirk.rebuild_parametrization_list, [Reduce(quirk.rebuild_builtin_parametrization,
                    "_WeightNorm", True, {"dim": 0}, {}, {})], (weight, weight), True, False, True, {}))  # fmt: skip


def test_rebuild_builtin_refuses_fields_outside_its_schema() -> None:
    u, v = torch.randn(4), torch.randn(3)
    good = ("_SpectralNorm", True, {"dim": 0, "eps": 1e-12, "n_power_iterations": 1}, {"_u": u, "_v": v}, {})
    assert quirk.rebuild_builtin_parametrization(*good).n_power_iterations == 1
    spectral = dict(good[2])
    bad = [
        ("_Parametrization", True, {}, {}, {}),
        ("Module", True, {}, {}, {}),
        ("_WeightNorm", True, {}, {}, {}),  # dim missing
        ("_WeightNorm", True, {"dim": 0, "forward": None}, {}, {}),  # a field of no schema
        ("_WeightNorm", True, {"dim": 2**70}, {}, {}),
        ("_WeightNorm", True, {"dim": 0}, {"_u": u}, {}),
        ("_WeightNorm", 1, {"dim": 0}, {}, {}),
        ("_SpectralNorm", True, {**spectral, "n_power_iterations": 0}, good[3], {}),
        ("_SpectralNorm", True, {**spectral, "n_power_iterations": 10**9}, good[3], {}),  # a forward that never ends
        ("_SpectralNorm", True, {**spectral, "eps": float("nan")}, good[3], {}),
        ("_SpectralNorm", True, spectral, {}, {}),  # iterations without vectors
        ("_SpectralNorm", True, spectral, {"_u": u}, {}),
        ("_SpectralNorm", True, spectral, {"_u": u.reshape(2, 2), "_v": v}, {}),
        ("_SpectralNorm", True, spectral, {"_u": u.long(), "_v": v.long()}, {}),
        ("_SpectralNorm", True, spectral, {"_u": nn.Parameter(u), "_v": v}, {}),
        ("_Orthogonal", True, {"shape": (4, 4), "orthogonal_map": "__class__"}, {}, {}),
        ("_Orthogonal", True, {"shape": (4, 4), "orthogonal_map": 1}, {}, {}),
        ("_Orthogonal", True, {"shape": [4, 4], "orthogonal_map": "cayley"}, {}, {}),
        ("_Orthogonal", True, {"shape": (4, 4), "orthogonal_map": "cayley"}, {"base": torch.randn(4)}, {}),
        ("_WeightNorm", True, {"dim": 0}, {}, {"_buffers": {}}),
        ("_WeightNorm", True, {"dim": 0}, {}, {"dim": 1}),
        ("_WeightNorm", True, {"dim": 0}, {}, {"right_inverse": None}),
        ("_WeightNorm", True, {"dim": 0}, {}, {"x" * 200: None}),
    ]
    for args in bad:
        with pytest.raises(zp.UnsafeArgumentError):
            quirk.rebuild_builtin_parametrization(*args)
    with pytest.raises(zp.SnapshotError, match="orthogonal_map"):
        _restricted(Reduce(quirk.rebuild_builtin_parametrization, "_Orthogonal", True,
                           {"shape": (2, 2), "orthogonal_map": "system"}, {}, {}))  # fmt: skip


def test_safe_globals_charge_the_load_budget() -> None:
    torch.manual_seed(0)
    state = _state(P.weight_norm(nn.Linear(3, 3)))
    with validate.budget(0):
        before = validate.remaining()
        quirk.set_parametrized_state(quirk.rebuild_parametrized_module(nn.Linear), state)
        spent = before - validate.remaining()  # type: ignore[operator]
    fields = state[0]
    assert spent >= len(fields) + len(fields["_modules"]) + len(fields["_parameters"])


def test_declares_only_validating_functions() -> None:
    import types

    registry = zp.default_registry()
    pairs = registry.safe_globals(plugins=["parametrize"])
    assert set(pairs) == {("zerocopy_pickle_quirks.parametrize", fn.__name__) for fn in quirk.SAFE_GLOBALS}
    for module, name in pairs:
        assert type(registry.resolve_safe_global(module, name)) is types.FunctionType

"""The offline feature cache (elsi_fast.training.feature_cache): what it holds, resuming a dump, its bound."""

from __future__ import annotations

import json

import pytest
import torch

from elsi_fast.targets.capture import capture_hidden_states
from elsi_fast.training import feature_cache as fc
from tiny_lm import TARGET, conversation_samples_of_tiny_target


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    return conversation_samples_of_tiny_target(tmp_path_factory.mktemp("conversations"), count=9)


def _direct(sample, layers):
    with torch.inference_mode(), capture_hidden_states(TARGET, layers=layers) as cap:
        final = TARGET.base_model(input_ids=sample.ids[None]).last_hidden_state[0]
    return torch.cat([cap.states[l][0] for l in layers], dim=-1), final


def test_the_cache_holds_each_samples_states_and_final_normed_state(samples, tmp_path):
    cache = fc.build(TARGET, samples, [3, 1], tmp_path, batch_size=4, progress=False)
    assert cache.complete and cache.layers == [1, 3]
    assert cache.nbytes == sum(len(s.ids) for s in samples) * 3 * 32 * 4  # (2 layers + final) x d x fp32
    ids, attention, loss, aux, final = cache.batch(samples, [4, 0], [3, 1])
    for b, i in enumerate((4, 0)):
        n = len(samples[i].ids)
        expected_aux, expected_final = _direct(samples[i], [3, 1])
        torch.testing.assert_close(aux[b, :n], expected_aux, rtol=1e-5, atol=1e-6)  # other padding, same math
        torch.testing.assert_close(final[b, :n], expected_final, rtol=1e-5, atol=1e-6)
        assert torch.equal(ids[b, :n], samples[i].ids) and torch.equal(loss[b, :n], samples[i].loss_mask)
        assert attention[b].sum() == n and not aux[b, n:].any()
    assert fc.open_cache(tmp_path).meta == cache.meta


def _interrupt_dump(samples, path, monkeypatch, forward_number: int) -> None:
    """Dump `samples` (layer 2) into `path` in batches of 2, with Ctrl-C in the `forward_number`-th forward."""
    real, calls = TARGET.base_model.forward, []

    def stop(*args, **kwargs):
        calls.append(1)
        if len(calls) == forward_number:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(TARGET.base_model, "forward", stop)
    with pytest.raises(KeyboardInterrupt):
        fc.build(TARGET, samples, [2], path, batch_size=2, progress=False)
    monkeypatch.setattr(TARGET.base_model, "forward", real)


def test_an_interrupted_dump_continues_to_the_same_cache(samples, tmp_path, monkeypatch):
    whole = fc.build(TARGET, samples, [2], tmp_path / "whole", batch_size=2, progress=False)
    _interrupt_dump(samples, tmp_path / "split", monkeypatch, 3)
    assert fc.open_cache(tmp_path / "split").meta["done"] == 4 and not fc.open_cache(tmp_path / "split").complete
    resumed = fc.build(TARGET, samples, [2], tmp_path / "split", batch_size=2, progress=False)
    everything = list(range(len(samples)))
    for got, want in zip(resumed.batch(samples, everything, [2]), whole.batch(samples, everything, [2])):
        assert torch.equal(got, want)


def test_bound_other_layers_and_bfloat16(samples, tmp_path):
    with pytest.raises(ValueError, match="max_cache_bytes: .* needs .* GiB, over the bound"):
        fc.build(TARGET, samples, [1, 2, 3], tmp_path / "small", max_bytes=1000, progress=False)
    assert not (tmp_path / "small").exists()
    fc.build(TARGET, samples, [1], tmp_path / "c", progress=False)
    with pytest.raises(ValueError, match="feature_cache: .* another target, data or layer set"):
        fc.build(TARGET, samples, [1, 2], tmp_path / "c", progress=False)
    half = fc.build(TARGET, samples, [1], tmp_path / "bf16", dtype="bfloat16", progress=False)
    full = fc.open_cache(tmp_path / "c")
    assert half.nbytes * 2 == full.nbytes
    torch.testing.assert_close(half.batch(samples, [0], [1])[3], full.batch(samples, [0], [1])[3], rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="cache_dtype"):
        fc.build(TARGET, samples, [1], tmp_path / "d", dtype="fp8")


def test_a_cache_grows_with_samples_appended_to_its_data(samples, tmp_path):
    first = fc.build(TARGET, samples[:5], [2], tmp_path / "grown", batch_size=2, progress=False)
    before = [t.clone() for t in first.batch(samples, range(5), [2])]
    grown = fc.build(TARGET, samples, [2], tmp_path / "grown", batch_size=2, progress=False)
    whole = fc.build(TARGET, samples, [2], tmp_path / "whole", batch_size=2, progress=False)
    assert grown.complete and grown.meta["samples"] == whole.meta["samples"] and grown.nbytes == whole.nbytes
    for kept, again in zip(before, grown.batch(samples, range(5), [2])):
        assert torch.equal(kept, again)  # the dumped samples are not dumped again
    for got, want in zip(grown.batch(samples, range(9), [2]), whole.batch(samples, range(9), [2])):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # other batches, same math
    assert fc.open_cache(tmp_path / "grown").meta == grown.meta
    # Not a prefix (reordered or edited data) is still refused.
    with pytest.raises(ValueError, match="another target, data or layer set"):
        fc.build(TARGET, samples[1:] + samples[:1], [2], tmp_path / "whole", progress=False)
    with pytest.raises(ValueError, match="max_cache_bytes: growing"):
        fc.build(TARGET, list(samples) + list(samples[:2]), [2], tmp_path / "grown", max_bytes=1000, progress=False)


def test_a_complete_cache_serves_a_prefix_of_its_samples_and_some_of_its_layers(samples, tmp_path):
    whole = fc.build(TARGET, samples, [1, 3], tmp_path / "c", batch_size=4, progress=False)
    prefix = fc.build(TARGET, samples[:4], [3], tmp_path / "c", progress=False)
    assert prefix.complete and prefix.layers == [1, 3]
    assert prefix.meta["samples"] == fc.samples_fingerprint(samples[:4])  # what train_draft checks
    assert fc.open_cache(tmp_path / "c").meta == whole.meta  # the folder keeps all its samples
    ids, _, loss, aux, final = prefix.batch(samples[:4], [3, 0], [3])
    for b, i in enumerate((3, 0)):
        n = len(samples[i].ids)
        expected_aux, expected_final = _direct(samples[i], [3])
        torch.testing.assert_close(aux[b, :n], expected_aux, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(final[b, :n], expected_final, rtol=1e-5, atol=1e-6)
        assert torch.equal(ids[b, :n], samples[i].ids) and torch.equal(loss[b, :n], samples[i].loss_mask)
    for other in (samples[1:5], samples[:3] + samples[4:5]):  # not its first samples
        with pytest.raises(ValueError, match="another target, data or layer set"):
            fc.build(TARGET, other, [3], tmp_path / "c", progress=False)
    with pytest.raises(ValueError, match="another target, data or layer set"):
        fc.build(TARGET, samples[:4], [2], tmp_path / "c", progress=False)  # a layer it lacks


def test_a_prefix_needs_the_whole_dump_and_the_digests(samples, tmp_path, monkeypatch):
    _interrupt_dump(samples, tmp_path / "c", monkeypatch, 2)
    with pytest.raises(ValueError, match="still dumping; build it with all its samples first"):
        fc.build(TARGET, samples[:3], [2], tmp_path / "c", progress=False)
    fc.build(TARGET, samples, [2], tmp_path / "c", progress=False)
    # A cache dumped before the digests were kept: its full sample list records them, then it serves.
    meta_path = tmp_path / "c" / fc.META_FILE
    meta = json.loads(meta_path.read_text())
    del meta["digests"]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="before it kept its samples' digests"):
        fc.build(TARGET, samples[:3], [2], tmp_path / "c", progress=False)
    assert fc.build(TARGET, samples, [2], tmp_path / "c", progress=False).meta["digests"] == fc.sample_digests(samples)
    assert fc.build(TARGET, samples[:3], [2], tmp_path / "c", progress=False).meta["lengths"] == \
        [len(s.ids) for s in samples[:3]]


def test_a_cache_without_final_states_dumps_only_the_layers_and_stops_the_forward(samples, tmp_path):
    """final=False: the same states as a full cache, no final.bin, and no block above the deepest
    layer runs; a full cache serves such a request, a layers-only cache refuses soft labels."""
    from elsi_fast.targets.capture import decoder_layers

    ran = []
    hooks = [b.register_forward_hook(lambda m, a, o, i=i: ran.append(i)) for i, b in enumerate(decoder_layers(TARGET))]
    try:
        states = fc.build(TARGET, samples[:5], [1, 2], tmp_path / "states", batch_size=2, final=False, progress=False)
    finally:
        for hook in hooks:
            hook.remove()
    assert set(ran) == {0, 1}  # h_2 is block 1's output: blocks 2.. never ran
    assert not (tmp_path / "states" / "final.bin").exists() and not states.has_final
    assert states.nbytes == sum(len(s.ids) for s in samples[:5]) * 2 * 32 * 4
    full = fc.build(TARGET, samples[:5], [1, 2], tmp_path / "full", batch_size=2, progress=False)
    got, want = states.batch(samples, range(5), [2, 1]), full.batch(samples, range(5), [2, 1])
    assert got[4] is None
    for a, b in zip(got[:4], want[:4]):
        assert torch.equal(a, b)
    assert fc.build(TARGET, samples[:5], [1], tmp_path / "full", final=False, progress=False).has_final
    with pytest.raises(ValueError, match="holds no final states"):
        fc.build(TARGET, samples[:5], [1, 2], tmp_path / "states", progress=False)
    grown = fc.build(TARGET, samples, [1, 2], tmp_path / "states", batch_size=2, final=False, progress=False)
    assert grown.complete and not (tmp_path / "states" / "final.bin").exists()
    assert fc.open_cache(tmp_path / "states").meta == grown.meta and not fc.open_cache(tmp_path / "states").has_final
    for a, b in zip(grown.batch(samples, range(9), [1]), fc.build(TARGET, samples, [1], tmp_path / "whole",
                                                                 final=False, progress=False).batch(samples, range(9), [1])):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_new_cache_copies_the_samples_other_caches_hold_and_dumps_the_rest(samples, tmp_path, monkeypatch):
    """reuse: samples dumped elsewhere (by digest, any position) are copied, with the columns of
    the layers asked for; only the others are forwarded; caches that cannot serve are passed over."""
    fc.build(TARGET, [samples[5], samples[1], samples[7]], [1, 2], tmp_path / "a", batch_size=2, progress=False)
    fc.build(TARGET, samples[:3], [1], tmp_path / "other-layer", progress=False)  # lacks layer 2
    fc.build(TARGET, samples[:3], [2], tmp_path / "half", dtype="bfloat16", progress=False)  # another dtype
    _interrupt_dump(samples, tmp_path / "partial", monkeypatch, 2)  # samples[:2]... in its order, then stopped
    partial = fc.open_cache(tmp_path / "partial").meta
    real, forwarded = TARGET.base_model.forward, []

    def count(*args, input_ids, **kwargs):
        forwarded.append(len(input_ids))
        return real(*args, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(TARGET.base_model, "forward", count)
    cache = fc.build(TARGET, samples, [2], tmp_path / "new", batch_size=2, final=False, progress=False,
                     reuse=[tmp_path / name for name in ("a", "other-layer", "half", "partial", "missing")])
    monkeypatch.setattr(TARGET.base_model, "forward", real)
    copied = {5, 1, 7} | set(partial["order"][: partial["done"]])
    assert sum(forwarded) == len(samples) - len(copied) and cache.complete
    whole = fc.build(TARGET, samples, [2], tmp_path / "whole", batch_size=2, final=False, progress=False)
    everything = list(range(len(samples)))
    for got, want in zip(cache.batch(samples, everything, [2]), whole.batch(samples, everything, [2])):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # other batches, same math
    aux = cache.batch(samples, [5], [2])[3][0, : len(samples[5].ids)]
    torch.testing.assert_close(aux, _direct(samples[5], [2])[0], rtol=1e-5, atol=1e-6)
    # A cache that needs the final state takes none from a cache without it.
    forwarded.clear()
    monkeypatch.setattr(TARGET.base_model, "forward", count)
    fc.build(TARGET, samples[:4], [2], tmp_path / "with-final", progress=False, reuse=[tmp_path / "new"])
    assert sum(forwarded) == 4

"""Weights sent in buckets (distributed/buckets.py), without Ray: a dict stands in for the object store."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from everyprompt.distributed.buckets import (
    ArrivingWeights,
    StreamedWeights,
    SyncAbandoned,
    WeightStream,
    packed_buckets,
    put_in_buckets,
    readable,
)
from everyprompt.models.io import load_one_by_one
from everyprompt.rollout import GenerationRequest, SamplingParams, make_engine
from tests.families import family_model
from tests.models.test_lora import adapted_policy


class Store:
    """An object store: `put` keeps a bucket under a new key, `get` returns it and counts the gets."""

    def __init__(self):
        self.objects: dict[int, dict] = {}
        self.gets = 0

    def put(self, bucket: dict) -> int:
        self.objects[len(self.objects)] = dict(bucket)
        return len(self.objects) - 1

    def get(self, key: int) -> dict:
        self.gets += 1
        return self.objects[key]


def _stored(weights, bucket_bytes: int, store: Store):
    """`packed_buckets`' buckets, each put in `store` as it comes (as rank 0's are stored by Ray)."""
    return ((store.put(bucket), names, n) for bucket, names, n in packed_buckets(weights, bucket_bytes))


def _floats(*sizes: int) -> list[tuple[str, torch.Tensor]]:
    return [(f"w{i}", torch.full((n,), float(i))) for i, n in enumerate(sizes)]


def test_buckets_fill_in_order_and_a_large_weight_goes_alone():
    """float32: 4, 4, 4, 12 and 4 bytes in buckets of 8: {w0, w1}, {w2}, {w3} (over a bucket: alone), {w4}."""
    store = Store()
    handle = put_in_buckets(_floats(1, 1, 1, 3, 1), 8, store.put)
    assert [names for _, names in handle.buckets] == [("w0", "w1"), ("w2",), ("w3",), ("w4",)]
    assert handle.nbytes == 28
    assert [sorted(store.objects[key]) for key, _ in handle.buckets] == [["w0", "w1"], ["w2"], ["w3"], ["w4"]]
    one = put_in_buckets(_floats(1, 1, 1, 3, 1), 1 << 20, Store().put)
    assert len(one.buckets) == 1
    with pytest.raises(ValueError, match="bucket_bytes must be positive, got 0"):
        put_in_buckets(_floats(1), 0, store.put)


def test_streamed_weights_fetch_a_bucket_when_first_read_and_keep_the_last_few():
    store = Store()
    handle = put_in_buckets(_floats(1, 1, 1, 1, 1, 1), 8, store.put)  # three buckets of two
    weights = StreamedWeights(handle, store.get, keep=2)
    assert len(weights) == 6 and list(weights) == [f"w{i}" for i in range(6)]
    assert "w5" in weights and "w9" not in weights and store.gets == 0  # names need no fetch
    assert torch.equal(weights["w0"], torch.zeros(1)) and weights["w1"].item() == 1.0
    assert store.gets == 1  # w1 shares w0's bucket
    weights["w4"]  # the ends first, as the native engine reads them
    weights["w2"]  # a third bucket: the least recently read one (w0's) goes
    assert store.gets == 3
    weights["w5"]  # held
    assert store.gets == 3
    weights["w0"]  # fetched again
    assert store.gets == 4
    weights["w4"]  # still held: w2's bucket (read least recently) went instead
    assert store.gets == 4
    weights["w3"]
    assert store.gets == 5
    with pytest.raises(KeyError):
        weights["w9"]
    with pytest.raises(ValueError, match="keep must be at least 1"):
        StreamedWeights(handle, store.get, keep=0)


def test_readable_streams_a_handle_and_leaves_a_state_dict():
    store = Store()
    handle = put_in_buckets(_floats(1, 1), 4, store.put)
    assert isinstance(readable(handle, store.get), StreamedWeights)
    plain = {"w": torch.ones(1)}
    assert readable(plain, store.get) is plain
    with pytest.raises(dataclasses.FrozenInstanceError):  # immutable: the async pipeline keeps it as is
        handle.nbytes = 0


def test_a_model_loads_streamed_weights_as_it_would_a_state_dict():
    model, _ = family_model("qwen3_moe")
    other, _ = family_model("qwen3_moe", seed=7)
    store = Store()
    handle = put_in_buckets(other.state_dict().items(), 16 << 10, store.put)
    assert len(handle.buckets) > 4
    streamed = StreamedWeights(handle, store.get)
    load_one_by_one(model, streamed)
    assert all(torch.equal(value, other.state_dict()[key]) for key, value in model.state_dict().items())
    assert store.gets == len(handle.buckets)  # in the model's order: each bucket fetched once
    with pytest.raises(KeyError, match="the weights do not fit Qwen3MoeForCausalLM"):
        load_one_by_one(model, {"lm_head.weight": other.lm_head.weight})
    wrong = dict(other.state_dict())
    wrong["lm_head.weight"] = wrong["lm_head.weight"][:-1]
    with pytest.raises(ValueError, match=r"lm_head.weight is \(\d+, \d+\) in the weights"):
        load_one_by_one(model, wrong)


@pytest.mark.parametrize("engine", ["native", "hf"])
def test_an_engine_synced_from_buckets_decodes_as_one_synced_from_a_state_dict(engine):
    """A LoRA policy's merged weights, put in small buckets as they are read, loaded by each engine: the same
    tokens and log-probs as from the whole merged state dict, each bucket fetched about once (the native
    engine reads its ends first: the first bucket twice at most)."""
    from everyprompt.models.lora import merged_state_dict

    policy, tokenizer = adapted_policy()
    base, _ = family_model("qwen3_moe", seed=5)
    whole = dict(merged_state_dict(policy))
    store = Store()
    handle = put_in_buckets(merged_state_dict(policy).items(), 8 << 10, store.put)
    assert len(handle.buckets) > 8
    assert handle.nbytes == sum(v.numel() * v.element_size() for v in whole.values())
    params = SamplingParams(8, temperature=1.0)
    requests = [GenerationRequest(i, tokenizer(p).input_ids, seed=i) for i, p in enumerate(["1+2=", "30+4="])]
    outputs = []
    for weights in (whole, StreamedWeights(handle, store.get)):
        synced = make_engine(engine, base, tokenizer, batch_size=2)
        synced.load_weights(weights)
        outputs.append({c.request_id: c for c in synced.generate(requests, params)})
    assert len(handle.buckets) <= store.gets <= len(handle.buckets) + 2
    a, b = outputs
    assert all(a[i].token_ids == b[i].token_ids and torch.equal(a[i].logprobs, b[i].logprobs) for i in a)


def test_buckets_are_yielded_as_each_fills():
    """A bucket is yielded before the weights of the next are read (all but the one that did not fit)."""
    read = []

    def weights():
        for name, tensor in _floats(1, 1, 1, 1):
            read.append(name)
            yield name, tensor

    stream = packed_buckets(weights(), 8)
    first = next(stream)
    assert first[1:] == (("w0", "w1"), 8) and read == ["w0", "w1", "w2"]  # w2 read: it did not fit
    assert [names for _, names, _ in stream] == [("w2", "w3")]


def test_a_weight_stream_is_handed_on_once_and_settles_into_a_handle():
    store = Store()
    stream = WeightStream(_stored(_floats(1, 1, 1), 8, store))
    assert [names for _, names in stream] == [("w0", "w1"), ("w2",)]
    handle = stream.settled()
    assert [names for _, names in handle.buckets] == [("w0", "w1"), ("w2",)] and handle.nbytes == 12
    with pytest.raises(RuntimeError, match="handed on once"):
        list(stream)
    unread = WeightStream(_stored(_floats(1, 1, 1), 8, Store()))
    assert unread.settled().nbytes == 12  # drained by settling


def test_arriving_weights_wait_for_a_bucket_that_has_not_arrived():
    store = Store()
    buckets = list(_stored(_floats(1, 1, 1), 4, store))  # one weight a bucket
    weights = ArrivingWeights(["w0", "w1", "w2"], store.get)
    assert "w2" in weights and len(weights) == 3 and list(weights) == ["w0", "w1", "w2"]  # no waiting
    got = {}
    reader = threading.Thread(target=lambda: got.update(w1=weights["w1"]))
    reader.start()
    reader.join(0.2)
    assert reader.is_alive() and not got  # waiting for w1's bucket
    ref, names, _ = buckets[1]
    weights.arrive(ref, names)  # buckets may arrive in any order
    reader.join(5)
    assert not reader.is_alive() and got["w1"].item() == 1.0
    weights.end(3)
    assert not weights.complete()  # the end said 3 buckets; one has come
    for ref, names, _ in (buckets[0], buckets[2]):
        weights.arrive(ref, names)
    weights.wait_complete()
    assert weights["w0"].item() == 0.0 and weights["w2"].item() == 2.0


def test_arriving_weights_name_what_never_came_and_a_sender_that_failed():
    store = Store()
    ref, names, _ = next(_stored(_floats(1), 4, store))
    weights = ArrivingWeights(["w0", "w9"], store.get)
    weights.arrive(ref, names)
    weights.end(1)
    with pytest.raises(KeyError, match="'w9' was not sent"):
        weights["w9"]
    abandoned = ArrivingWeights(["w0"], store.get)
    errors = []

    def read():
        try:
            abandoned["w0"]
        except SyncAbandoned as err:
            errors.append(err)

    reader = threading.Thread(target=read)
    reader.start()
    abandoned.end()  # the sender failed: a waiting reader is told, not left waiting
    reader.join(5)
    assert not reader.is_alive() and "its sender failed before sending w0" in str(errors[0])
    abandoned.wait_complete()  # returns: nothing more will come


@pytest.mark.parametrize("engine", ["native", "hf"])
def test_an_engine_loads_buckets_as_they_arrive_as_it_would_a_state_dict(engine):
    """A sender thread puts the merged weights in small buckets, in the order engines read them, and hands
    each on as it is put; the engine loading them meanwhile decodes as one given the whole state dict."""
    from everyprompt.models.io import weights_as_held
    from everyprompt.models.lora import merged_state_dict

    policy, tokenizer = adapted_policy()
    base, _ = family_model("qwen3_moe", seed=5)
    whole = dict(merged_state_dict(policy))
    store = Store()
    order = list(weights_as_held(whole, None))
    assert [n for n, _ in order[:3]] == ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    arriving = ArrivingWeights(list(whole), store.get)

    def send():
        count = 0
        for ref, names, _ in _stored(iter(order), 8 << 10, store):
            arriving.arrive(ref, names)
            count += 1
            time.sleep(0.001)
        arriving.end(count)

    params = SamplingParams(8, temperature=1.0)
    requests = [GenerationRequest(i, tokenizer(p).input_ids, seed=i) for i, p in enumerate(["1+2=", "30+4="])]
    outputs = []
    for weights in ("whole", "arriving"):
        synced = make_engine(engine, base, tokenizer, batch_size=2)
        if weights == "whole":
            synced.load_weights(whole)
        else:
            sender = threading.Thread(target=send)
            sender.start()
            synced.load_weights(arriving)
            sender.join()
        outputs.append({c.request_id: c for c in synced.generate(requests, params)})
    a, b = outputs
    assert all(a[i].token_ids == b[i].token_ids and torch.equal(a[i].logprobs, b[i].logprobs) for i in a)


def test_a_bucket_is_stored_as_bytes_and_read_back_as_views_of_them():
    """Each tensor goes into the store as its bytes, dtype and shape (one copy in, none out): read back,
    every dtype and shape is as sent, and the tensors view the stored bytes."""
    from everyprompt.distributed.buckets import packed, unpacked

    bucket = {
        "f32": torch.randn(3, 4),
        "bf16": torch.randn(5).to(torch.bfloat16),
        "fp8": torch.randn(4, 2).to(torch.float8_e4m3fn),
        "ids": torch.arange(6).reshape(2, 3),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "transposed": torch.randn(4, 3).T,  # not contiguous: its bytes are made contiguous first
    }
    stored = packed(bucket)
    assert all(data.dtype.name == "uint8" and data.ndim == 1 for data, _, _ in stored.values())
    back = unpacked(stored)
    for name, tensor in bucket.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape, name
        flat = tensor.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(back[name].reshape(-1).view(torch.uint8), flat), name
        assert back[name].data_ptr() == stored[name][0].ctypes.data or tensor.numel() == 0, name

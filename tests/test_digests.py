"""Weight digests are computed once while the weights stay as they are, and again after any change."""
import copy
import hashlib
import json

import torch
from torch import nn

from pyserini_aligner.digests import cached_digest
from pyserini_aligner.onnx_runtime import weights_digest


def reference_fingerprint(model) -> str:
    """The fingerprint as its definition reads: sha256 over the config less its description, then each weight's name,
    shape and float32 bytes in name order."""
    h = hashlib.sha256()
    config = {k: v for k, v in model.config.to_dict().items() if k != "description"}
    h.update(json.dumps(config, sort_keys=True).encode())
    for name, tensor in sorted(model.state_dict().items()):
        data = tensor.detach().float().contiguous()
        h.update(f"{name}:{list(data.shape)}".encode())
        h.update(data.numpy().tobytes())
    return h.hexdigest()


def counted(module: nn.Module) -> tuple[list[int], callable]:
    calls = [0]

    def digest() -> str:
        calls[0] += 1
        h = hashlib.sha256()
        for name, tensor in sorted(module.state_dict().items()):
            h.update(name.encode() + tensor.detach().numpy().tobytes())
        return h.hexdigest()

    return calls, lambda: cached_digest(module, "test", digest)


def test_a_digest_is_computed_once_until_the_weights_change():
    module = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    calls, digest = counted(module)
    first = digest()
    assert digest() == first and calls == [1]
    with torch.no_grad():
        module[0].weight.add_(1.0)  # in place
    second = digest()
    assert second != first and calls == [2]
    module[0].weight.data = module[0].weight.data.clone() * 2  # a new storage behind the same parameter
    third = digest()
    assert third not in (first, second) and calls == [3]
    module.load_state_dict({k: torch.zeros_like(v) for k, v in module.state_dict().items()})
    fourth = digest()
    assert fourth not in (first, second, third) and calls == [4]
    module[0] = nn.Linear(4, 3)  # a new parameter, perhaps where a freed one lived
    assert digest() != fourth and calls == [5]
    assert digest() and calls == [5]


def test_the_salt_names_what_else_the_digest_covers():
    module = nn.Linear(2, 2)
    assert cached_digest(module, "a", lambda: "one") == "one"
    assert cached_digest(module, "b", lambda: "two") == "two"
    assert cached_digest(module, "a", lambda: "three") == "one"


def test_fingerprint_and_onnx_digest_follow_the_weights(model):
    model = copy.deepcopy(model)
    assert model.fingerprint() == reference_fingerprint(model) == model.fingerprint()
    tower = model._query_tower()
    before = weights_digest(tower)
    assert weights_digest(model._query_tower()) == before  # a new wrapper over the same tensors
    with torch.no_grad():
        model.projection.weight.mul_(0.5)
    assert model.fingerprint() == reference_fingerprint(model)
    assert weights_digest(model._query_tower()) != before
    model.config.description = "another description"  # not part of the fingerprint
    fingerprint = model.fingerprint()
    assert fingerprint == reference_fingerprint(model)
    model.config.doc_maxlen += 1  # the config is
    assert model.fingerprint() != fingerprint and model.fingerprint() == reference_fingerprint(model)

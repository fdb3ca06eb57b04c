"""Config dataclasses: JSON round trip, canonical checksum, and one ConfigError for malformed input."""

from __future__ import annotations

import json

import pytest

from gsm.config import ConfigError, GSMParams, KVQuantConfig, ModelConfig, gsm_checksum

BASE = {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 2,
        "num_key_value_heads": 1, "vocab_size": 10}


def test_round_trip_and_checksum():
    cfg = ModelConfig(**BASE, gsm=GSMParams(kv_sharing={2: 0}, shared_layers=(0,)))
    d = cfg.to_json()
    assert d["gsm_config"]["kv_sharing"] == {"2": 0}
    back = ModelConfig.from_json(json.loads(json.dumps(d)))
    assert back == cfg
    assert back.owning_layers == [0, 1] and back.sharing_layers == [2]
    # canonical: key order and whitespace of the file do not matter
    g = d["gsm_config"]
    shuffled = json.loads(json.dumps(dict(reversed(list(g.items()))), indent=4))
    assert gsm_checksum(shuffled) == g["checksum"]
    assert gsm_checksum({**g, "sparse_top_k": 65}) != g["checksum"]


def test_checksum_is_sha256_of_canonical_json():
    import hashlib

    g = {"b": [1, 2], "a": 0.5, "checksum": "x"}
    assert gsm_checksum(g) == "sha256:" + hashlib.sha256(b'{"a":0.5,"b":[1,2]}').hexdigest()


@pytest.mark.parametrize("patch, fragment", [
    ({"eos_token_id": []}, "malformed"),
    ({"gsm_config": {"kv_sharing": [1, 2]}}, "gsm_config"),
    ({"gsm_config": {"shared_layers": 5}}, "gsm_config"),
    ({"gsm_config": {"kv_sharing": {"1": 2}}}, "earlier layer"),
    ({"gsm_config": {"kv_sharing": {"2": 1, "1": 0}}}, "itself sharing"),
    ({"gsm_config": {"kv_sharing": {"7": 0}}}, "names layer 7"),
    ({"gsm_config": {"sparse_window": 9, "max_sparse_window": 8}}, "max_sparse_window"),
    ({"num_key_value_heads": 3}, "multiple"),
    ({"hidden_size": "8"}, "positive integer"),
    ({"torch_dtype": "int8"}, "torch_dtype"),
    ({"gsm_config": None}, "gsm_config"),
])
def test_malformed_config_is_one_config_error(patch, fragment):
    d = {**BASE, "gsm_config": {}, **patch}
    with pytest.raises(ConfigError, match=fragment):
        ModelConfig.from_json(d)


def test_missing_gsm_config_and_fields():
    with pytest.raises(ConfigError, match="no gsm_config"):
        ModelConfig.from_json(dict(BASE))
    with pytest.raises(ConfigError, match="lacks vocab_size"):
        ModelConfig.from_json({k: v for k, v in {**BASE, "gsm_config": {}}.items() if k != "vocab_size"})


def test_quant_config():
    q = KVQuantConfig()
    assert q.is_gsm and KVQuantConfig.from_json(q.to_json()) == q
    assert not KVQuantConfig(bit_widths=(16, 8)).is_gsm
    for bad in ({"kv_quantization": {"tier_fractions": [0.5, 0.6, 0.1]}},
                {"kv_quantization": {"hotness_decay": 1.0}}, {"kv_quantization": {"tier_fractions": 3}}, {}):
        with pytest.raises(ConfigError):
            KVQuantConfig.from_json(bad)

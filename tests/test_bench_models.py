"""The models benchmark family (benchmarks/models.py): every workload traces, compiles
and agrees with its float32 reference at smoke size; the suite's plumbing for it
(families in --workloads, a float32-only workload in a bfloat16 run, runs split by
backend merged)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import models, report, suite
from benchmarks.workloads import WORKLOADS, family_members

MODELS = family_members(["models"])


def _cfg(tmp_path, workloads, backends, dtypes=("bfloat16",)):
    return suite.SuiteConfig(workloads=list(workloads), backends=list(backends), dtypes=list(dtypes),
                             size_preset="smoke", repeats=1, min_round_s=0.0005, warmup=0, output=str(tmp_path),
                             plots=False, seed=11, progress=False)


# The 12-layer step is the GPT-2 block's layers stacked (XLA's CPU compile of it: 20 s);
# tests/test_shared_triton.py runs it at its smoke size under pallaskit against jax.jit.
@pytest.mark.parametrize("name", [m for m in MODELS if m != "gpt2_12layer_train"])
def test_models_family_runs_under_xla_and_agrees(tmp_path, name):
    """jax.jit of each workload against the float32 reference (one test each, so the
    suite's workers share them); the optimizer, float32 only, runs in float32 in a
    bfloat16 run."""
    results = suite.run(_cfg(tmp_path, [name], ["xla"]))
    (row,) = results["rows"]
    assert row["workload"] == name and row["status"] == "ok" and row["value"] > 0 and row["floor"] > 0, row
    assert row["dtype"] == ("float32" if name.startswith("adamw") else "bfloat16")
    if name == "adamw_update":
        assert "adamw_update: no bfloat16 version; runs in float32" in results["notes"]


def test_models_family_members():
    assert {"gpt2_block_train", "llama_block_train", "gpt2_12layer_train", "adamw_update", "resnet_block_train",
            "xent_take_along_axis", "lstm_scan"} <= set(MODELS)


@pytest.mark.parametrize("name", ["xent_take_along_axis", "lstm_scan"])
def test_models_cheap_idioms_run_under_pallaskit(tmp_path, name):
    """pallaskit on the cheap idioms (gather / scan fallbacks)."""
    pk = suite.run(_cfg(tmp_path, [name], ["pallaskit"]))
    assert [r["status"] for r in pk["rows"]] == ["ok"], pk["rows"]


def test_training_step_updates_along_the_clipped_gradient():
    """The step's loss is the loss, the new first moment is 0.1 x the clipped gradient (what
    the agreement check compares), and with a zero first moment every parameter moves
    against its gradient, besides weight decay."""
    w = WORKLOADS["llama_block_train"]
    inputs = w.make_inputs(w.sizes["smoke"], jnp.dtype("float32"), jax.random.key(2))
    out = jax.jit(w.jax_fn)(*inputs)
    n = (len(inputs) - 3) // 3
    params, new, mus = inputs[3:3 + n], out[1:1 + n], out[1 + n:1 + 2 * n]
    before, grads = jax.jit(jax.value_and_grad(models._LLAMA_LOSS))(params, *inputs[:2])
    np.testing.assert_allclose(out[0], before, rtol=1e-5)
    norm = float(jnp.sqrt(sum(jnp.sum(g * g) for g in grads)))
    for p, q, g, mu in zip(params, new, grads, mus):
        g = np.asarray(g) * min(1.0, models.MAX_NORM / norm)
        np.testing.assert_allclose(mu, 0.1 * g, rtol=1e-4, atol=1e-5 * np.abs(g).max())
        update = -(np.asarray(q, np.float64) - np.asarray(p)) / models.LR - models.WEIGHT_DECAY * np.asarray(p)
        big = np.abs(g) > 1e-2 * np.abs(g).max()
        assert big.any() and np.all(np.sign(update[big]) == np.sign(g[big]))


def test_adamw_clips_by_the_global_norm():
    grads = (jnp.full((3,), 4.0), jnp.full((2, 2), -2.0))  # global norm 8
    zeros = tuple(jnp.zeros_like(g) for g in grads)
    for scale, factor in ((1.0, 1 / 8), (1 / 16, 1.0)):  # over the limit: scaled to norm 1; under it: kept
        g = tuple(x * scale for x in grads)
        _, mu, nu = jax.jit(models.adamw)(zeros, g, zeros, zeros, jnp.asarray(0, jnp.int32))
        for x, m, v in zip(g, mu, nu):
            np.testing.assert_allclose(m, 0.1 * factor * x, rtol=1e-6)
            np.testing.assert_allclose(v, 0.001 * (factor * x) ** 2, rtol=1e-6)


def test_dtypes_for_runs_a_float32_only_workload_in_float32(tmp_path):
    s = suite.Suite(_cfg(tmp_path, ["adamw_update", "add"], ["xla"], dtypes=("bfloat16", "float16")))
    assert s.dtypes_for(WORKLOADS["adamw_update"]) == ["float32"]
    assert s.dtypes_for(WORKLOADS["add"]) == ["bfloat16", "float16"]
    s = suite.Suite(_cfg(tmp_path, ["adamw_update"], ["xla"], dtypes=("bfloat16", "float32")))
    assert s.dtypes_for(WORKLOADS["adamw_update"]) == ["float32"]


def test_families():
    assert set(MODELS) >= {"gpt2_block_train", "llama_block_train", "gpt2_12layer_train", "adamw_update",
                           "resnet_block_train", "xent_take_along_axis", "xent_one_hot", "lstm_scan",
                           "gpt2_block_fwd"}
    kernels = family_members(["kernels"])
    assert "add" in kernels and not set(kernels) & set(MODELS)
    assert family_members(["add", "models"]) == ["add"] + MODELS
    # the full-size parameter counts the descriptions promise
    assert models.parameter_count("gpt2_12layer_train", WORKLOADS["gpt2_12layer_train"].sizes["full"])[0] > 150
    arrays, elements = models.parameter_count("adamw_update", WORKLOADS["adamw_update"].sizes["full"])
    assert 100 <= arrays <= 300 and 110e6 < elements < 130e6


def test_merge_keeps_other_backends_rows():
    """A run split by backend merges: the later run replaces only its own backends' rows."""
    def part(backend, value):
        return {"meta": {"command": backend}, "notes": [],
                "rows": [{"workload": "adamw_update", "dtype": "float32", "backend": backend, "value": value}]}
    merged = report.merge([part("xla", 1.0), part("pallaskit", 2.0), part("xla", 3.0)])
    assert sorted((r["backend"], r["value"]) for r in merged["rows"]) == [("pallaskit", 2.0), ("xla", 3.0)]

"""A predictor file given to ``caote generate --predictor``, ``caote eval --predictor`` or ``caote validate`` is
checked before the model loads, from the file and the model's config and fingerprint
(`caote.predictor.Predictor.check_file` against `caote.models.model_identity`): a file that is not a predictor, NaN
weights, weights of another shape or of another model are one line, exit 2, and the model never loads."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from conftest import load_as, tiny_model
from safetensors.torch import save_file
from test_cli import run_main

from caote.models import ModelIdentity, model_config, model_identity
from caote.predictor import PREDICTOR_DIR, Predictor, config_shape, model_fingerprint, shipped_fingerprint

SHIPPED = PREDICTOR_DIR / "smollm2-135m.safetensors"  # the bundled model's, (30 layers, 3 KV heads, 156 features)
OTHER_MODEL = PREDICTOR_DIR / "gemma3-270m.safetensors"  # (18, 1, 540)

# each file -> the refusal it gets given for the bundled model
REFUSALS = {
    "garbage": "cannot read predictor '{path}': ",
    "no-metadata": "predictor '{path}' holds no predictor metadata (feature set, model, fingerprint)",
    "nan": "predictor '{path}' (calibrated for 'smollm2-135m') holds NaN or infinite weights",
    "a-layer-short": "predictor '{path}' (calibrated for 'smollm2-135m') holds weights of shape (29, 3, 156), not the "
    "(layers, KV heads, features) (30, 3, 156) of 'smollm2-135m'",
    "other-model": "predictor '{path}' was calibrated for 'gemma3-270m', not 'smollm2-135m'",
    "same-shapes-other-model": "predictor '{path}' was calibrated for 'smollm2-135m-base', not 'smollm2-135m'",
}
# (command line, option) of each command taking a predictor file; {file} and {out} filled in per test
COMMANDS = {
    "generate": (["generate", "hi", "--predictor", "{file}"], "--predictor"),
    "eval": (["eval", "perplexity", "--predictor", "{file}", "--out", "{out}"], "--predictor"),
    "validate": (["validate", "{file}", "--out", "{out}/p.safetensors"], "PREDICTOR"),
}


def bad_file(name: str, folder: Path) -> Path:
    """The predictor file ``name`` of `REFUSALS`, written into ``folder``."""
    path = folder / f"{name}.safetensors"
    shipped = Predictor.load(SHIPPED)

    def save(weights, model=shipped.model, fingerprint=shipped.fingerprint) -> Path:
        return Predictor(weights, shipped.groups, model, fingerprint, shipped.texts, dict(shipped.details)).save(path)

    if name == "garbage":
        path.write_bytes(b"not a predictor at all")
    elif name == "no-metadata":
        save_file({"weights": torch.zeros(30, 3, 156)}, str(path))
    elif name == "nan":
        save(shipped.weights.clone().index_fill(2, torch.tensor([5]), float("nan")))
    elif name == "a-layer-short":
        save(shipped.weights[:-1].clone())
    elif name == "other-model":
        path.write_bytes(OTHER_MODEL.read_bytes())
    elif name == "same-shapes-other-model":
        save(shipped.weights.clone(), model="smollm2-135m-base", fingerprint="0123456789abcdef")
    return path


@pytest.fixture
def nothing_loads(monkeypatch):
    """Any model load fails the test."""

    def loaded(*args, **kwargs):
        pytest.fail("the model was loaded")

    monkeypatch.setattr("caote.models.load_model", loaded)
    monkeypatch.setattr("caote.evaluation.report.load_model", loaded)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("name", REFUSALS)
def test_a_bad_predictor_file_is_one_line_exit_2_before_the_model_loads(
    capsys, tokenizer, nothing_loads, tmp_path, command, name
):
    """``tokenizer``: the bundled model is there (its config and fingerprint are what the file is checked against)."""
    path = bad_file(name, tmp_path)
    argv, option = COMMANDS[command]
    code, out, err = run_main(capsys, *(part.format(file=path, out=tmp_path) for part in argv))
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"caote {command}: error: {option}: {REFUSALS[name].format(path=path)}"), err


def test_the_shipped_predictor_passes_the_check_before_loading(tokenizer):
    predictor = Predictor.check_file(SHIPPED, "smollm2-135m", *model_identity("smollm2-135m"))
    assert predictor.fingerprint == shipped_fingerprint("smollm2-135m")


def test_the_bundled_models_identity_is_its_loaded_ones(tokenizer, tmp_path, monkeypatch):
    """The fingerprint its shipped predictors record, and its config: from the converted copy, or before the first
    conversion from the GGUF file's header; either gives the shapes of the predictor it ships."""
    identity = model_identity("smollm2-135m")
    assert identity.fingerprint == Predictor.load(SHIPPED).fingerprint
    shipped = Predictor.load(SHIPPED)
    assert config_shape(identity.config, shipped.groups) == tuple(shipped.weights.shape) == (30, 3, 156)
    monkeypatch.setenv("CAOTE_CACHE_DIR", str(tmp_path))  # not converted yet
    before = model_config("smollm2-135m")
    assert config_shape(before, shipped.groups) == (30, 3, 156)
    assert list(tmp_path.iterdir()) == []  # reading the config converted nothing


def test_another_models_identity_is_its_config_alone(llama, tmp_path):
    llama.config.save_pretrained(tmp_path)
    identity = model_identity(str(tmp_path))
    assert identity.fingerprint is None  # known only once it loads
    assert identity.config.num_hidden_layers == llama.config.num_hidden_layers
    assert model_identity("nobody-has/this-model") == ModelIdentity(None, None)  # not in the local cache
    (tmp_path / "config.json").write_text("{}")
    assert model_identity(str(tmp_path)).config is None  # loading it says why


def test_check_file_refuses_what_it_can_tell_and_passes_the_rest(llama, qwen3, tmp_path):
    predictor = Predictor.for_model(llama)  # calibrated on the fly (conftest)
    path = predictor.save(tmp_path / "llama.safetensors")
    fitting = Predictor.check_file(path, "tiny", llama.config, model_fingerprint(llama))
    assert fitting.fingerprint == predictor.fingerprint
    assert Predictor.check_file(path, "tiny").fingerprint == predictor.fingerprint  # nothing known of the model
    with pytest.raises(ValueError, match="calibrated for .* not 'qwen'; calibrate one with: caote calibrate --model"):
        Predictor.check_file(path, "qwen", qwen3.config, model_fingerprint(qwen3))
    deeper = copy.deepcopy(llama.config)
    deeper.num_hidden_layers = 3
    layers, heads, features = predictor.weights.shape
    with pytest.raises(
        ValueError, match=rf"shape \({layers}, {heads}, {features}\), not the .* \(3, {heads}, {features}\) of 'deep'"
    ):
        Predictor.check_file(path, "deep", deeper)
    nan = Predictor(predictor.weights.clone().fill_(float("nan")), predictor.groups, "tiny", "x", [], {})
    with pytest.raises(ValueError, match="holds NaN or infinite weights"):
        Predictor.check_file(nan.save(tmp_path / "nan.safetensors"), "tiny")


@pytest.mark.parametrize("command", ["validate", "eval"])
def test_another_models_predictor_is_refused_once_the_loaded_model_tells(
    capsys, tokenizer, monkeypatch, tmp_path, command
):
    """A local model's fingerprint is known only once it loads: a predictor of its shapes but another model's weights
    is refused then, in one line, exit 2, before any validation or row."""
    model = tiny_model("llama", vocab_size=49152, max_position_embeddings=256)
    load_as(monkeypatch, model, tokenizer)
    monkeypatch.setattr("caote.evaluation.report.load_model", lambda *args, **kwargs: (model, tokenizer))
    monkeypatch.setattr("caote.models.model_identity", lambda name: ModelIdentity(model.config, None))
    monkeypatch.setattr("caote.validate_command.validate_into", lambda *args: pytest.fail("validation started"))
    monkeypatch.setattr("caote.evaluation.report.run_rows", lambda *args: pytest.fail("rows started"))
    fitted = Predictor.for_model(model)  # calibrated on the fly (conftest)
    other = Predictor(fitted.weights, fitted.groups, "another-llama", "0123456789abcdef", [], {})
    path = other.save(tmp_path / "other.safetensors")
    argv, option = {
        "validate": (["validate", str(path), "--out", str(tmp_path / "p.safetensors")], "PREDICTOR"),
        "eval": (["eval", "perplexity", "--predictor", str(path), "--out", str(tmp_path / "rows")], "--predictor"),
    }[command]
    code, out, err = run_main(capsys, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(
        f"caote {command}: error: {option}: predictor '{path}' was calibrated for 'another-llama', not"
    ), err

"""Model names are checked before anything loads: one-line errors at once, and the first conversion is announced."""

from __future__ import annotations

import io
import time

import huggingface_hub.constants
import pytest

import caote
from caote import models
from caote.models import announce_conversion, load_model, resolve_model_path

NOT_CACHED_HUB_ID = "caote-tests/no-such-model-0123"


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.fixture
def online(monkeypatch):
    """Offline mode off (whatever the environment says), so that a test decides reachability itself."""
    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


@pytest.mark.parametrize("name", ["/no/such/dir", "./no-such-dir", "~/no/such/dir", "models/no/such"])
def test_a_missing_directory_is_a_one_line_value_error(name):
    start = time.perf_counter()
    with pytest.raises(ValueError, match="no such directory") as error:
        load_model(name)
    assert name in one_line(error)
    assert time.perf_counter() - start < 5


def test_a_file_or_a_folder_without_config_is_refused(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="is a file, not a directory") as error:
        load_model(str(tmp_path / "weights.bin"))
    one_line(error)
    with pytest.raises(ValueError, match="has no config.json") as error:
        load_model(tmp_path)
    one_line(error)


def test_a_name_that_is_neither_a_path_nor_a_hub_id_is_refused():
    with pytest.raises(ValueError, match="neither an existing directory nor a hub id") as error:
        load_model("not a model!")
    one_line(error)


def test_an_uncached_hub_id_fails_at_once_in_offline_mode(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(models, "_hub_reachable", lambda *args, **kwargs: pytest.fail("offline mode must not probe"))
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="offline mode is on") as error:
        load_model(NOT_CACHED_HUB_ID)
    assert NOT_CACHED_HUB_ID in one_line(error)
    assert time.perf_counter() - start < 5


def test_an_uncached_hub_id_fails_at_once_without_network(monkeypatch, online):
    monkeypatch.setattr(models, "_hub_reachable", lambda *args, **kwargs: False)
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="cannot be reached") as error:
        load_model(NOT_CACHED_HUB_ID)
    assert NOT_CACHED_HUB_ID in one_line(error)
    assert time.perf_counter() - start < 5


def test_the_hub_probe_answers_within_its_timeout(monkeypatch, online):
    for variable in models._PROXY_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "https://nonexistent.invalid")
    start = time.perf_counter()
    assert models._hub_reachable(timeout=1.0) is False
    assert time.perf_counter() - start < 5


def test_a_cached_hub_id_loads_from_the_cache_only_when_the_hub_is_unreachable(monkeypatch, online):
    monkeypatch.setattr(models, "_in_hub_cache", lambda repo_id: True)
    monkeypatch.setattr(models, "_hub_reachable", lambda *args, **kwargs: False)
    assert models.check_model_name("org/cached-model") == {"local_files_only": True}
    monkeypatch.setattr(models, "_hub_reachable", lambda *args, **kwargs: True)
    assert models.check_model_name("org/cached-model") == {}


def test_generate_given_a_model_name_says_to_load_it_first():
    with pytest.raises(ValueError, match=r"caote\.models\.load_model\('smollm2-135m'\)") as error:
        caote.generate("smollm2-135m", None, "Hello", budget=64)
    one_line(error)


def test_the_conversion_announcement_says_what_where_how_big_and_how_to_move_it(tmp_path):
    stream = io.StringIO()
    announce_conversion(tmp_path / "smollm2-135m-instruct", stream=stream)
    text = stream.getvalue()
    assert text.count("\n") == 1
    for part in ("float32", str(tmp_path / "smollm2-135m-instruct"), "540 MB", "CAOTE_CACHE_DIR", "once"):
        assert part in text


def test_the_first_use_of_the_bundled_model_announces_its_conversion_once(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("CAOTE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(models, "bundled_gguf_path", lambda: tmp_path / "model.gguf")
    conversions = []

    def fake_convert(target, model):  # stands in for the 25 s conversion
        conversions.append(target)
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_convert_bundled", fake_convert)
    first = resolve_model_path("smollm2-135m")
    second = resolve_model_path("smollm2-135m")
    assert first == second == str(tmp_path / "smollm2-135m-instruct") and len(conversions) == 1
    err = capsys.readouterr().err
    assert err.count("caote: first use of 'smollm2-135m'") == 1 and "CAOTE_CACHE_DIR" in err


def test_load_model_shows_caotes_notice_but_not_transformers_loading_bar(monkeypatch, tmp_path, capsys, tokenizer):
    from transformers.utils import logging as transformers_logging

    from caote.testing import tiny_model

    monkeypatch.setenv("CAOTE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(models, "bundled_gguf_path", lambda: tmp_path / "model.gguf")

    def fake_convert(target, model):  # a tiny model stands in for the 25 s conversion
        tiny_model("llama").save_pretrained(target)
        tokenizer.save_pretrained(target)

    monkeypatch.setattr(models, "_convert_bundled", fake_convert)
    shown = transformers_logging.is_progress_bar_enabled()
    transformers_logging.enable_progress_bar()
    try:
        load_model("smollm2-135m")
        assert transformers_logging.is_progress_bar_enabled()  # shown again after the load
    finally:
        (transformers_logging.enable_progress_bar if shown else transformers_logging.disable_progress_bar)()
    err = capsys.readouterr().err
    assert "Loading weights" not in err and err.count("caote: first use of 'smollm2-135m'") == 1, err

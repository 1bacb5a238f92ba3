"""The predictor file of the ``learned`` policies: per-(layer, KV head) weights over the features of
`caote.learned`, with what they were fitted on and what validation found.

A file is a safetensors tensor ``weights`` ``(L, H_kv, F)`` whose metadata name the feature set, the model (and a
fingerprint of its architecture and weights), the calibration texts and the recipe (``caote calibrate``,
`caote.evaluation.calibration`). `Predictor.for_model` finds the committed one of a model (`PREDICTOR_DIR`; a model
may ship one per range of budgets, `Predictor.min_budget`) or reads one given, and refuses in one line a file that
cannot be read, belongs to another model or does not fit it; `Predictor.check_file` does so before the model loads,
from its config and (a bundled model's) fingerprint, where the command line has only the model's name. The verdict
of the validation (`caote.evaluation.validation`) travels in the file: `Predictor.helps` is what ``auto`` reads.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from caote.learned import FEATURE_SET, LayerPredictor, feature_names

# the verdicts of a predictor's validation (`Predictor.helps`): the learned policy beats every training-free one
VERDICT_HELPS = "helps"
VERDICT_DOES_NOT_HELP = "does not help"
PREDICTOR_DIR = Path(__file__).parent / "predictors"  # the committed predictors (of the bundled models)


def model_fingerprint(model: nn.Module) -> str:
    """A short id of a model's architecture and weights, the same in every dtype: the shapes of its config and the
    mean absolute value of its first embedding rows, to three significant digits (base and instruct models of one
    architecture differ there)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    embedding = model.get_input_embeddings().weight[:64].detach().float()
    shape = [
        config.model_type,
        config.num_hidden_layers,
        config.num_attention_heads,
        getattr(config, "num_key_value_heads", config.num_attention_heads),
        config.hidden_size,
        config.vocab_size,
        f"{embedding.abs().mean().item():.3g}",
    ]
    return hashlib.sha256(json.dumps(shape).encode()).hexdigest()[:16]


def shipped_fingerprint(model: str) -> str | None:
    """The fingerprint of the model named ``model`` (a bundled model's name), as the predictors shipped for it record
    it, without loading it; None when none ships for that name or they disagree."""
    found = {
        header.get("fingerprint")
        for header in map(_header, sorted(PREDICTOR_DIR.glob("*.safetensors")))
        if header.get("model") == model
    }
    return found.pop() if len(found) == 1 else None


def config_shape(config, groups: tuple[str, ...]) -> tuple[int, int, int]:
    """The ``(layers, KV heads, features)`` of a predictor over ``groups`` for the model of transformers ``config``,
    from the config alone (what `Predictor.check_fits` reads from the loaded model)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return config.num_hidden_layers, kv_heads, len(feature_names(groups, head_dim))


def _header(path: Path) -> dict:
    """A predictor file's metadata (its model, fingerprint, ...) without its weights; empty when it cannot be read."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as file:
            return file.metadata() or {}
    except (OSError, RuntimeError, ValueError, SafetensorError):
        return {}


def _min_budget(header: dict) -> int:
    """`Predictor.min_budget` from a file's metadata, without its weights."""
    try:
        return int(json.loads(header.get("details", "{}")).get("min_budget", 0))
    except (ValueError, TypeError, AttributeError):
        return 0


@dataclass
class Predictor:
    """Per-(layer, KV head) weights ``(L, H_kv, F)`` over the features of ``groups`` and what they were fitted on."""

    weights: torch.Tensor
    groups: tuple[str, ...]
    model: str
    fingerprint: str
    texts: list[str]  # the calibration texts' ids (never evaluated: `caote.evaluation.splits.check_disjoint`)
    details: dict  # how it was calibrated (budgets, recent window, ridge strengths, held-out losses, seconds)

    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        metadata = {
            "feature_set": FEATURE_SET,
            "groups": json.dumps(list(self.groups)),
            "model": self.model,
            "fingerprint": self.fingerprint,
            "texts": json.dumps(self.texts),
            "details": json.dumps(self.details),
        }
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")  # a killed save leaves no half-written file
        try:
            save_file({"weights": self.weights.float().contiguous()}, str(partial), metadata=metadata)
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
        return path

    @classmethod
    def load(cls, path: str | Path) -> Predictor:
        """The predictor saved at ``path``, read once per file version (caches are built often, e.g. per grid cell;
        treat it as read-only). A file that is not a predictor is a one-line `ValueError`."""
        path = Path(path).resolve()
        try:
            status = path.stat()
        except OSError as error:
            raise ValueError(f"cannot read predictor {str(path)!r}: {error.strerror}") from None
        return _read_predictor(str(path), (status.st_mtime_ns, status.st_size, status.st_ino))

    @classmethod
    def _read(cls, path: str) -> Predictor:
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(path, framework="pt") as file:
                metadata = file.metadata() or {}
                weights = file.get_tensor("weights")
        except (OSError, RuntimeError, ValueError, KeyError, SafetensorError) as error:
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise ValueError(
                f"cannot read predictor {path!r}: {reason}; write one with: caote calibrate --model <model> --out FILE"
            ) from None
        if "feature_set" not in metadata:  # a safetensors file, not a predictor
            raise ValueError(
                f"predictor {path!r} holds no predictor metadata (feature set, model, fingerprint): not written by "
                "caote calibrate; write one with: caote calibrate --model <model> --out FILE"
            )
        missing = {"groups", "model", "fingerprint", "texts", "details"} - set(metadata)
        if missing and metadata.get("feature_set") == FEATURE_SET:
            raise ValueError(f"predictor {path!r} lacks {', '.join(sorted(missing))}: not written by caote calibrate")
        if metadata.get("feature_set") != FEATURE_SET:
            raise ValueError(
                f"predictor {str(path)!r} has feature set {metadata.get('feature_set')!r}, this caote reads "
                f"{FEATURE_SET!r}: calibrate it again with `caote calibrate`"
            )
        return cls(
            weights=weights,
            groups=tuple(json.loads(metadata["groups"])),
            model=metadata["model"],
            fingerprint=metadata["fingerprint"],
            texts=json.loads(metadata["texts"]),
            details=json.loads(metadata["details"]),
        )

    @classmethod
    def for_model(cls, model: nn.Module, path: str | Path | None = None, budget: int | None = None) -> Predictor:
        """The predictor at ``path``, or the committed one calibrated for ``model`` at ``budget`` (`shipped_for`); a
        one-line `ValueError` when there is none or it was calibrated for another model."""
        name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        if path is not None:
            predictor = cls.load(path)
            if predictor.fingerprint != model_fingerprint(model):
                raise ValueError(
                    f"predictor {str(path)!r} was calibrated for {predictor.model!r}, not this model ({name!r}); "
                    f"calibrate one with: caote calibrate --model <this model> --out FILE"
                )
            return predictor.check_fits(model, repr(str(path)))
        shipped = cls.shipped_for(model, budget)
        if shipped is None:
            committed = dict.fromkeys(  # a model shipping several (one per range of budgets) is named once
                _header(candidate).get("model", candidate.stem)
                for candidate in sorted(PREDICTOR_DIR.glob("*.safetensors"))
            )
            raise ValueError(
                f"policy 'learned' needs a predictor calibrated for {name!r}: run `caote calibrate --model <model> "
                f"--out FILE` and pass predictor=FILE (--predictor FILE); only {', '.join(committed) or 'no model'} "
                "ship one"
            )
        return shipped

    @classmethod
    def shipped_for(cls, model: nn.Module, budget: int | None = None) -> Predictor | None:
        """The committed predictor calibrated for ``model`` (matched by fingerprint) at ``budget``: of a model's
        files, the one of the largest `min_budget` not above it (None: the one for every budget), or None when
        caote ships none for the model; a shipped file that does not fit the model, or two files of the model with
        the same `min_budget`, are refused in one line, never taken for a missing one."""
        fingerprint = model_fingerprint(model)
        headers = {path: _header(path) for path in sorted(PREDICTOR_DIR.glob("*.safetensors"))}
        # another model's file is never read whole
        candidates = {
            path: _min_budget(header) for path, header in headers.items() if header.get("fingerprint") == fingerprint
        }
        if not candidates:
            return None
        tied = [least for least, count in Counter(candidates.values()).items() if count > 1]
        if tied:
            names = ", ".join(path.name for path, least in candidates.items() if least == tied[0])
            raise ValueError(
                f"{names} in {PREDICTOR_DIR} are shipped for the same model from the same budget ({tied[0]}): give "
                "each its own min_budget or remove all but one"
            )
        eligible = [path for path, least in candidates.items() if least <= (budget or 0)]
        chosen = max(eligible, key=candidates.get) if eligible else min(candidates, key=candidates.get)
        predictor = cls.load(chosen)
        return predictor.check_fits(model, predictor.shipped_source)

    @property
    def min_budget(self) -> int:
        """The smallest budget this predictor is for where a model ships several (`shipped_for`); 0: every budget."""
        return int(self.details.get("min_budget", 0))

    @property
    def shipped_source(self) -> str:
        """How messages name this predictor as a shipped one: ``"shipped for 'smollm2-135m'"``, with ``" at
        budgets from 1024"`` for one meant for large budgets only."""
        return f"shipped for {self.model!r}" + (f" at budgets from {self.min_budget}" if self.min_budget else "")

    @classmethod
    def check_file(cls, path: str | Path, model: str, config=None, fingerprint: str | None = None) -> Predictor:
        """The predictor at ``path`` (`load`) checked for the model named ``model`` before it loads, from the file
        alone: refused in one line when it was calibrated for another model (``fingerprint``: the model's, where it
        is known before loading, `shipped_fingerprint`), its weights are not shaped as ``config`` (the model's
        transformers config) says, or they are NaN or infinite. ``config`` or ``fingerprint`` None: not known before
        the model loads; `for_model` checks the loaded model."""
        predictor = cls.load(path)
        source = repr(str(path))
        if fingerprint is not None and predictor.fingerprint != fingerprint:
            raise ValueError(
                f"predictor {source} was calibrated for {predictor.model!r}, not {model!r}; calibrate one with: "
                f"caote calibrate --model {model} --out FILE"
            )
        want = None if config is None else config_shape(config, predictor.groups)
        return predictor._check_weights(want, f"{source} (calibrated for {predictor.model!r})", model)

    def check_fits(self, model: nn.Module, source: str) -> Predictor:
        """This predictor, refused in one line unless its weights are finite and shaped as ``model``'s (layers, KV
        heads, features): a file edited or truncated by hand would otherwise fail inside `generate`."""
        layers = model.get_decoder().layers
        features = len(feature_names(self.groups, layers[0].self_attn.head_dim))
        return self._check_weights((len(layers), model.config.num_key_value_heads, features), source)

    def _check_weights(self, want: tuple[int, int, int] | None, source: str, model: str | None = None) -> Predictor:
        """This predictor, refused in one line unless its weights are finite and (``want`` not None) of shape ``want``,
        the (layers, KV heads, features) of ``model`` (None: the loaded model at hand)."""
        if want is not None and tuple(self.weights.shape) != want:
            shape = tuple(self.weights.shape)
            expected = (
                f"this model's (layers, KV heads, features) {want}"
                if model is None
                else f"the (layers, KV heads, features) {want} of {model!r}"
            )
            raise ValueError(
                f"predictor {source} holds weights of shape {shape}, not {expected}: calibrate one with: caote "
                f"calibrate --model {'<this model>' if model is None else model} --out FILE"
            )
        if not bool(torch.isfinite(self.weights).all()):
            raise ValueError(f"predictor {source} holds NaN or infinite weights: calibrate it again (caote calibrate)")
        return self

    @property
    def validation(self) -> dict | None:
        """What ``caote calibrate`` measured on dev excerpts it did not fit on (`caote.evaluation.validation`):
        ``texts``, ``budgets``, ``kl`` (policy -> budget -> per-excerpt KL), ``verdict``, ``learned`` (the learned
        policy the verdict is about); None for a predictor written before validation existed."""
        return self.details.get("validation")

    @property
    def helps(self) -> bool:
        """Whether validation found the learned policy better than every training-free one (`VERDICT_HELPS`)."""
        return self.validation is not None and self.validation.get("verdict") == VERDICT_HELPS

    def verdict_line(self, source: str) -> str:
        """One line for a user loading this predictor: what validation said, or that it was never validated."""
        validation = self.validation
        if validation is None:
            return f"caote: predictor {source} was not validated (calibrate it again to get a verdict)"
        budgets = "/".join(str(budget) for budget in validation["budgets"])
        return (
            f"caote: predictor {source}: {validation['verdict']} ({validation['summary']}; "
            f"{len(validation['texts'])} dev excerpts, budgets {budgets})"
        )

    def layer(self, index: int, unrotate: Callable | None, sink_tokens: int) -> LayerPredictor:
        return LayerPredictor(self.weights[index], self.groups, unrotate, sink_tokens)

    def stacked(self, layers: list[int], batch: int, unrotate: Callable | None, sink_tokens: int) -> LayerPredictor:
        """The predictor of a stack of ``layers``' batch rows (``batch`` each, in order: `caote.stacking`): weights
        ``(len(layers) * batch, H_kv, F)``, each row its layer's."""
        weights = self.weights[torch.tensor(layers)].repeat_interleave(batch, dim=0)
        return LayerPredictor(weights, self.groups, unrotate, sink_tokens)


@functools.lru_cache(maxsize=16)
def _read_predictor(path: str, version: tuple[int, int, int]) -> Predictor:
    return Predictor._read(path)

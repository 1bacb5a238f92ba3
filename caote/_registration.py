"""Register the ``caote-text-generation`` pipeline with transformers without importing ``transformers.pipelines``.

Importing ``transformers.pipelines`` costs seconds (it pulls in every pipeline and their dependencies), so
``import caote`` does not do it. Instead `install` either registers at once, when ``transformers.pipelines`` is
already imported, or puts a one-shot finder on ``sys.meta_path`` that registers right after ``transformers.pipelines``
finishes importing (e.g. on ``from transformers import pipeline``). Either way, ``import caote`` followed by
``pipeline("caote-text-generation", ...)`` works as documented. This module imports nothing heavy.
"""

from __future__ import annotations

import importlib
import sys
import warnings

TARGET = "transformers.pipelines"


def register_now() -> None:
    """Import `caote.pipeline`, which registers the task at the end of its own import (idempotent)."""
    module = importlib.import_module("caote.pipeline")
    register = getattr(module, "register", None)
    if register is not None:  # None while caote.pipeline is still importing: its last line registers then
        register()


class _RegisteringLoader:
    """Runs the real loader of ``transformers.pipelines``, then registers; everything else is delegated."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        # put the real loader back first, so that nothing keeps seeing this wrapper
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        uninstall()
        try:
            register_now()
        except Exception as error:  # never break the user's import of transformers.pipelines
            warnings.warn(f"caote: could not register the caote-text-generation pipeline: {error}", stacklevel=2)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class PipelineRegistrationFinder:
    """A one-shot `sys.meta_path` finder: finds ``transformers.pipelines`` with the other finders and wraps its
    loader so that the caote pipeline is registered once the module has run, and the finder removed (a bare
    ``importlib.util.find_spec`` that loads nothing leaves it in place)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TARGET:
            return None
        for finder in list(sys.meta_path):
            if isinstance(finder, PipelineRegistrationFinder):
                continue
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _RegisteringLoader(spec.loader)
        return spec


def installed() -> bool:
    return any(isinstance(finder, PipelineRegistrationFinder) for finder in sys.meta_path)


def uninstall() -> None:
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, PipelineRegistrationFinder)]


def install() -> None:
    """Register now if ``transformers.pipelines`` is imported, else on its first import (idempotent)."""
    if TARGET in sys.modules:
        register_now()
    elif not installed():
        sys.meta_path.insert(0, PipelineRegistrationFinder())

"""The split guards: a predictor is fitted on dev-split documents and judged on documents it never read.

Texts are excerpts of documents, named ``<kind>-<document>-<length>[-<excerpt>]`` (`document_of`). Calibration
reads the dev split only (`check_calibration_texts`); its validation holds whole documents out of the fit
(`hold_out`); the evaluation refuses a learned policy on any text drawing on a document its predictor was calibrated
on, at any length (`check_disjoint`).
"""

from __future__ import annotations

import re
from pathlib import Path

from caote.evaluation.data import essay_names, split_of

MIN_EXCERPTS = 6  # fewer held-out excerpts than this give no verdict
TEXT_ID = re.compile(r"(essay|code|file)-(.+?)-(\d+)(?:-\d+)?")  # <kind>-<document>-<length>[-<excerpt>]
JOINED_ID = re.compile(r"essays-joined\d+-\d+")  # a window of a split's essays joined (`data.joined_essay_excerpts`)


def document_of(text_id: str) -> str:
    """The document a text id is an excerpt of (``essay-gap-1024-3`` -> ``essay:gap``); other ids are their own."""
    match = TEXT_ID.fullmatch(text_id)
    return f"{match.group(1)}:{match.group(2)}" if match else text_id


def documents_of(text_id: str, split: str) -> set[str]:
    """The documents a text of ``split`` draws on: its own (`document_of`), or every essay of the split for a window
    of the joined essays (which spans several)."""
    if JOINED_ID.fullmatch(text_id):
        return {f"essay:{Path(name).stem}" for name in essay_names(split)}
    return {document_of(text_id)}


def check_calibration_texts(texts) -> None:
    """Refuse any text of an evaluation split: calibration reads dev-split essays or code only (a text from a
    folder, whose id is neither ``essay-`` nor ``code-``, is the user's own)."""
    test = [
        text.id
        for text in texts
        if text.id.startswith(("essay-", "code-"))
        and split_of(text.unit + ".txt" if text.id.startswith("essay-") else text.unit) != "dev"
    ]
    if test:
        raise ValueError(
            f"calibration texts must come from the dev split; {len(test)} are evaluation texts ({', '.join(test[:3])})"
        )


def check_disjoint(predictor, text_ids, split: str = "test") -> None:
    """Refuse to evaluate a learned policy on a text (of ``split``) drawing on a document (any excerpt, any length)
    its `caote.predictor.Predictor` was calibrated on."""
    earlier = [text_id for texts in predictor.details.get("rolled_out_by", []) for text_id in texts]
    calibrated = {document_of(text_id) for text_id in [*predictor.texts, *earlier]}
    shared = sorted(text_id for text_id in text_ids if documents_of(text_id, split) & calibrated)
    if shared:
        raise ValueError(
            f"the predictor was calibrated on the documents of {len(shared)} of the texts to evaluate "
            f"({', '.join(shared[:3])}): calibrate on the dev split and evaluate on test"
        )


def hold_out(texts: list, excerpts: int = MIN_EXCERPTS) -> tuple[list, list]:
    """``(fit, held)``: the documents last in ``texts``' order are held out, one by one, until they give
    ``excerpts`` excerpts (taken a document's first excerpt each, then the second, ...), while at least half of the
    documents remain for the fit; ``held`` is empty when that cannot reach ``excerpts``."""
    documents = list(dict.fromkeys(document_of(text.id) for text in texts))
    held_documents: list[str] = []
    for document in reversed(documents):
        if sum(document_of(text.id) in held_documents for text in texts) >= excerpts:
            break
        if len(held_documents) + 1 > len(documents) // 2:
            return texts, []
        held_documents.append(document)
    held = [text for text in texts if document_of(text.id) in held_documents]
    if len(held) < excerpts:
        return texts, []
    return [text for text in texts if document_of(text.id) not in held_documents], held[:excerpts]

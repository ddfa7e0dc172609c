"""Which layout a forward runs, decided in one place (`choose_path`) from the config, the batch's facts as the input
checks read them (input_checks.py), the call's options and what is attached to the encoder."""

from typing import NamedTuple

import torch
from transformers.utils import logging

from .input_checks import BatchFacts

logger = logging.get_logger(__name__)


class Path(NamedTuple):
    """The layout of one forward."""

    packed: bool  # sequences concatenated in one row, split by their markers (DataCollatorWithFlattening)
    padded: bool | None  # the attention mask has padding (None: traced with a mask, the mask decides at run time)
    unpadded: bool  # the padding-free layout: every layer on the (P, H) rows of real tokens; else the padded one
    bucketed: bool  # on the padding-free layout, the CPU's bucketed rows (bert_padding.py); else the exact ones


def choose_path(config, facts: BatchFacts, device: torch.device, output_attentions: bool, cache_length: int,
                looking_inside) -> Path:
    """The layout of a forward. Packed: by cu_seq_lens_q / seq_idx, or by position_ids restarting in one row without a
    mask (under torch.compile: position_ids in one row, one sequence giving the same result as unpacked; under
    torch.export only the markers, so that its graph stays free of data-dependent shapes). Padding-free: where there
    is padding to skip (or the batch is packed), unless `config.unpad_inputs` is False, attention maps are asked for
    (the padded path has them), the `eager` attention is set, keys are cached (prefix tuning), or, with
    `unpad_inputs` None, `looking_inside()` names code of the user's that must see stock's (B, T, H) tensors (said once
    in the log). Bucketed on the CPU, except when training under torch.compile (the bucketed attention is then an
    opaque op without a backward). A batch of padding only runs padded: nothing to unpad."""
    compiling = torch.compiler.is_compiling()
    if compiling:  # nothing was read: the markers decide, and under torch.compile a row of position_ids
        exporting = torch.compiler.is_exporting()  # asked only when tracing: torch 2.6 has no is_exporting
        packed, work = facts.marked or (facts.packable and not exporting), not exporting
    else:
        packed, work = facts.marked or facts.num_sequences > 1, facts.nnz > 0
    work = work and (packed or facts.padding is not False)  # rows to skip
    wanted = (work and config.unpad_inputs is not False and not output_attentions and not cache_length
              and config._attn_implementation != "eager")
    observer = looking_inside() if wanted and config.unpad_inputs is None else None
    say_padded_for(observer, compiling)
    bucketed = device.type == "cpu" and not (compiling and torch.is_grad_enabled())
    return Path(packed, facts.padding, wanted and observer is None, bucketed)


def say_padded_for(observer: str | None, compiling: bool) -> None:
    """Once: what of the user's made calls with padding run the padded layout (a traced program cannot log; the eager
    call before it did)."""
    if observer is not None and not compiling:
        logger.warning_once(
            f"{observer}: calls with padding run the padded layout, so that it sees stock BERT's (B, T, H) tensors; "
            "set config.unpad_inputs=True to keep the padding-free layout (hooks then see the (P, H) rows of real "
            "tokens)")

"""How many sequences of a few lengths a KV cache holds at once, as both memory plans (the config
plan before loading, the profiled plan after) say it: as planned (a windowed layer group holds a
window of each sequence) and, for a hybrid model, as if every layer kept the whole context, so
the windows' saving is stated where a user reads the plan (the start-up log, `kiln bench`'s
record)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

# The lengths the plans report besides the run's own max_model_len (the long-context rows').
REPORT_LENGTHS = (4096, 32768, 131072)


def report_lengths(max_model_len: int) -> list[int]:
    """REPORT_LENGTHS that a request of this engine can reach, and max_model_len itself."""
    return sorted({n for n in REPORT_LENGTHS if n < max_model_len} | {max_model_len})


def fits_record(
    lengths: Sequence[int], planned: Callable[[int], int], every_layer: Callable[[int], int]
) -> dict[str, dict[str, int]]:
    """{length: {"planned": n, "every_layer": m}} (JSON keys are strings)."""
    return {str(n): {"planned": planned(n), "every_layer": every_layer(n)} for n in lengths}


def fits_text(
    lengths: Sequence[int],
    planned: Callable[[int], int],
    every_layer: Callable[[int], int],
    windows: Sequence[int | None],
) -> str:
    """'sequences at once A x 4096, B x 32768', and where some layer groups have a window,
    what the same memory would hold if every layer kept its whole context."""
    text = "sequences at once " + ", ".join(f"{planned(n)} x {n}" for n in lengths)
    if len(windows) > 1:
        every = ", ".join(f"{every_layer(n)} x {n}" for n in lengths)
        kinds = sorted({w for w in windows if w is not None})
        text += (
            f" (layers of window {', '.join(map(str, kinds))} counted at it; every "
            f"layer's whole context would hold {every})"
        )
    return text

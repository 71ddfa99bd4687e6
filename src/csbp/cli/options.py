"""Argument types shared by several subcommands; a bad value is one argparse error line naming the flag."""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from csbp.atomic import streams_to, unwritable_reason


def device_option(text: str) -> str:
    """``--device``: a torch device string this machine has (``cpu``, ``cuda``, ``cuda:1``, ``mps``)."""
    import torch  # here: commands without --device (csbp plan) do not import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device (use cpu, cuda or cuda:N)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text}: CUDA is not available here (use --device cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError(f"{text}: MPS is not available here (use --device cpu)")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise argparse.ArgumentTypeError(f"{text}: csbp runs on cpu, cuda or mps")
    return text


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return int_at_least(1)(text)


LARGEST_INT_OPTION = 2**63 - 1
"""No integer flag takes more (a 10**30 reached torch or numpy: an OverflowError traceback): the
config's ``MAX_INT64``, written out here so that parsing flags imports no config (and no torch)."""


def int_at_least(low: int, *, high: int = LARGEST_INT_OPTION, why: str = "") -> Callable[[str], int]:
    """An integer >= ``low`` (``--seq-len``: 2, ``--seed``: 0) and at most ``high`` (default
    :data:`LARGEST_INT_OPTION`; a lower one says ``why``), refused by argparse naming the flag."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be >= {low}")
        if value > high:
            limit = "2^63 - 1" if high == LARGEST_INT_OPTION else str(high)
            raise argparse.ArgumentTypeError(f"{value} is too large (at most {limit}{': ' * bool(why)}{why})")
        return value

    return parse


def float_in(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Callable[[str], float]:
    """A number in ``[low, high]`` (``(`` / ``)`` where open; ``high`` may be ``inf``, never reached)."""
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if math.isinf(high):
        interval = f"a finite number {'>' if low_open else '>='} {low:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        above = value > low if low_open else value >= low
        below = value < high if high_open else value <= high
        if not (above and below and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{text} must {'be' if math.isinf(high) else 'lie in'} {interval}")
        return value

    return parse


def check_layout_flags(cp: int, bp: int) -> None:
    """``ValueError`` naming ``--cp``/``--bp`` when they form no CSBP layout (the ``Topology`` built
    from them would say so in Python words: ``Topology(cp=3, bp=4)``)."""
    if cp > 1 and bp > 1 and (bp < cp or bp % cp):
        raise ValueError(
            f"--cp {cp} --bp {bp}: not a fused CSBP layout: --bp must be a multiple of --cp "
            f"(fix: e.g. --bp {-(-max(bp, cp) // cp) * cp}, or --bp 1 for CP only, --cp 1 for BP only)"
        )


def check_model_directory(model_dir: Path) -> Path:
    """``--model``: a Hugging Face checkpoint directory (``config.json`` + safetensors), such as a run's
    ``final/``; a ``ValueError`` naming the fix for a run directory, a checkpoint or anything else."""
    if not model_dir.is_dir():
        raise ValueError(f"--model {model_dir} is not a directory; pass a HF checkpoint directory (e.g. RUN/final)")
    if (model_dir / "config.json").is_file():
        return model_dir
    if (model_dir / "final" / "config.json").is_file():
        what = f"is a run directory (fix: --model {model_dir / 'final'}, the model it exported)"
    elif (model_dir / "trainer_state.json").is_file() or (model_dir / "latest").is_file():
        what = (
            f"holds training checkpoints (fix: export one first, `csbp export {shlex.quote(str(model_dir))} --out DIR`, then "
            "--model DIR; or pass the run's final/ export)"
        )
    else:
        what = "has no config.json, so it is not a HF checkpoint directory (fix: pass one, e.g. RUN/final)"
    raise ValueError(f"--model {model_dir} {what}")


def token_name(example: str) -> Callable[[str], str]:
    """``--mask-token``/``--eos-token``: the name of a token of the tokenizer; an empty one names none
    (``--mask-token ''`` fell back to the default name as if the flag were not given)."""

    def parse(text: str) -> str:
        if not text:
            raise argparse.ArgumentTypeError(
                f"an empty name names no token (fix: a token of the tokenizer, e.g. {example}, or drop the flag)"
            )
        return text

    return parse


def positive_float(text: str) -> float:
    """A finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number > 0")
    return value


def path_option(text: str) -> Path:
    """A path flag's value, never empty: ``Path("")`` is ``.``, so ``--run-dir ''`` (an unset shell
    variable) trained into the working directory. ``.`` still names it."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r} is an empty path (fix: name a path, or . for the working directory)"
        )
    return Path(text)


def output_file(text: str) -> Path:
    """An output file (``--json``, ``--png``, ``plan calibrate --out``) that can be written, checked
    before any work: not empty, not a directory, and its nearest existing parent is a writable directory
    (missing parents are created when it is written)."""
    path = path_option(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory (fix: name a file, e.g. {path / 'out.json'})")
    if streams_to(path):  # /dev/null, /dev/stdout, a pipe: written into, so its directory need not be writable
        if not os.access(path, os.W_OK):
            raise argparse.ArgumentTypeError(f"{text}: not writable (fix: choose another path)")
        return path
    problem = unwritable_reason(path.absolute().parent)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text}: {problem} (fix: choose another path)")
    return path


RESOLVE_TIMEOUT_S = 10.0
"""How long ``--rdzv-endpoint``'s host may take to resolve (a lookup of a name no server answers for
can take minutes; torch's rendezvous then retried it without end)."""

_HOST_NAME = re.compile(r"^[\w.:-]+$")  # what torch's parse_rendezvous_endpoint accepts


def rendezvous_endpoint(text: str) -> str:
    """``--rdzv-endpoint HOST:PORT`` with a port in 1..65535 (torch said "must be an integer between 0
    and 65536" as a raw library line, after the data checks); whether HOST resolves is
    :func:`check_endpoint_resolves`'s, run by the command (parsing looks nothing up)."""
    example = "(fix: HOST:PORT of the first node, e.g. node0:29500 or 10.0.0.1:29500)"
    host, sep, port_text = text.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):  # [IPv6]:PORT
        host = host[1:-1]
    if not sep or not host or not port_text:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT {example}")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text}: port {port_text!r} is not a number in 1..65535 {example}")
    if not _HOST_NAME.match(host):
        raise argparse.ArgumentTypeError(f"{text}: {host!r} is not a host name or IP address {example}")
    return text.strip()


def check_endpoint_resolves(endpoint: str, flag: str = "--rdzv-endpoint") -> None:
    """``ValueError`` unless the host of ``endpoint`` (as :func:`rendezvous_endpoint` took it)
    resolves within :data:`RESOLVE_TIMEOUT_S` (an unresolvable host hung torch's rendezvous)."""
    host, _, port = endpoint.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    problem = _resolve_problem(host, int(port), RESOLVE_TIMEOUT_S)
    if problem is not None:
        raise ValueError(
            f"{flag} {endpoint}: host {host!r} {problem} (fix: check the name, or pass the first node's IP address)"
        )


def _resolve_problem(host: str, port: int, timeout_s: float) -> str | None:
    """Why ``host`` does not resolve (``getaddrinfo`` in a daemon thread: it has no timeout of its own),
    else None."""
    failure: list[str] = []

    def look_up() -> None:
        try:
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            failure.append(getattr(exc, "strerror", None) or str(exc) or type(exc).__name__)

    lookup = threading.Thread(target=look_up, name="csbp-resolve", daemon=True)
    lookup.start()
    lookup.join(timeout_s)
    if lookup.is_alive():
        return f"did not resolve within {timeout_s:g} s"
    return f"does not resolve ({failure[0]})" if failure else None


def add_diagonal_option(parser: argparse.ArgumentParser, *, reference: bool = False) -> None:
    """``--diagonal``: the kernel of the noisy block diagonal (``csbp.attention.diagonal``; the run
    config's ``attention.diagonal``); ``flex`` needs the flex backend, refused before any work."""
    from csbp.attention.diagonal import DIAGONALS

    note = "; the reference runs dense attention under the mask predicates" if reference else ""
    parser.add_argument(
        "--diagonal", choices=DIAGONALS, default="auto",
        help="block-diagonal kernel (auto: sdpa on tiles for B >= 16, matmul below, flex on flex; "
        f"sdpa_fold folds GQA heads into the rows; flex needs --backend flex){note}",
    )



def add_clean_option(parser: argparse.ArgumentParser, *, reference: bool = False) -> None:
    """``--clean``: the kernel of the clean-context partials (``csbp.attention.flash_pieces``; the run
    config's ``attention.clean``)."""
    from csbp.attention.backends import CLEAN_KERNELS

    note = "; the reference runs dense attention under the mask predicates" if reference else ""
    parser.add_argument(
        "--clean", choices=CLEAN_KERNELS, default="generic",
        help="clean-context kernel (generic: one backend partial; pieces: dense and causal pieces as fused flash "
        f"calls plus a residual, FlashAttention-2 on CUDA; pieces-cudnn: cuDNN pieces on CUDA){note}",
    )


class _DeprecatedAlias(argparse.Action):
    """Stores like the option it stands for and notes the current spelling on stderr (old scripts
    keep working; ``--help`` no longer lists it)."""

    def __init__(self, option_strings: list[str], dest: str, *, current: str, **kwargs: object) -> None:
        self.current = current
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object, option_string: str | None = None
    ) -> None:
        print(f"csbp: warning: {option_string} is deprecated here; use {self.current}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_deprecated_alias(
    parser: argparse.ArgumentParser, old: str, *, current: str, dest: str, choices: tuple[str, ...]
) -> None:
    """``old`` as a hidden spelling of the option ``current`` (same ``dest`` and ``choices``)."""
    parser.add_argument(old, dest=dest, choices=choices, action=_DeprecatedAlias, current=current)


def add_override_argument(parser: argparse.ArgumentParser) -> None:
    """``--set KEY=VALUE`` (repeatable), shared by every command that loads a config."""
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        dest="overrides",
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set optim.lr=3e-4 (repeatable; YAML values)",
    )

"""The benchmarks' reports: cell formats, the run's header lines, and the writer. Every report is
written twice: markdown for reading (under the run's stamp line) and JSON for tools
(``{"run": {commit, device, date, versions}, "tables": [[{column: cell}, ...], ...]}``, the
markdown's tables as rows), so every results file names the commit, device, date and versions."""

import datetime
import functools
import json
import os
import platform
import subprocess

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def short(exc, limit=160):
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ").replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def version(module_name):
    try:
        from importlib import metadata

        return metadata.version(module_name)
    except Exception:  # noqa: BLE001
        return "not installed"


def fmt_ms(ms):
    return "-" if ms is None else (f"{ms:.3f}" if ms < 10 else f"{ms:.2f}")


def fmt_ratio(a, b):
    return "-" if a is None or b is None or b <= 0 else f"{a / b:.2f}"


def fmt_mem(nbytes, logits_bytes):
    if nbytes is None:
        return "n/a"
    return f"{nbytes / 2**30:.2f} ({nbytes / logits_bytes:.1f}x)"


def fmt_per_token(nbytes, tokens):
    return "n/a" if nbytes is None else f"{nbytes / tokens:.0f}"


def header_lines(device, extra=()):
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = f"{props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB)"
    else:
        name = f"CPU ({platform.processor() or platform.machine()})"
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = "not installed"
    try:
        import mindspeed_cez

        cez = f"{mindspeed_cez.__version__} from {os.path.dirname(mindspeed_cez.__file__)}"
    except Exception as exc:  # noqa: BLE001
        cez = short(exc)
    lines = [
        f"- device: {name}",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- python {platform.python_version()}, torch {torch.__version__}, triton {triton_version}, "
        f"megatron-core {version('megatron-core')}, liger-kernel {version('liger-kernel')}",
        f"- mindspeed_cez {cez}",
        f"- env: TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')!r}, "
        f"MINDSPEED_CEZ_BACKEND={os.environ.get('MINDSPEED_CEZ_BACKEND', '')!r}",
    ]
    return lines + list(extra)


def commit():
    """``git rev-parse --short HEAD`` of this checkout (``+dirty`` with uncommitted changes), or why not."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except Exception:  # noqa: BLE001 - no git, or not a checkout (a copied working tree)
        return "unknown (no git checkout)"


def device_name():
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()})"


@functools.lru_cache(maxsize=None)
def run_info():
    """Commit, device, date and package versions of this run (taken once per process)."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = "not installed"
    return {"commit": commit(), "device": device_name(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "python": platform.python_version(), "torch": torch.__version__, "triton": triton_version,
            "megatron-core": version("megatron-core"), "liger-kernel": version("liger-kernel")}


def run_stamp():
    """One line: commit, device, date and package versions of this run."""
    i = run_info()
    return (f"Run: commit {i['commit']}; {i['device']}; {i['date']}; python {i['python']}, torch {i['torch']}, "
            f"triton {i['triton']}, megatron-core {i['megatron-core']}")


def tables(lines):
    """The markdown tables in ``lines`` as lists of ``{column: cell}`` rows (separator rows left out)."""
    found, header = [], None
    for line in "\n".join(lines).splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            found.append([])
        elif not all(set(c) <= set("-: ") for c in cells):
            found[-1].append(dict(zip(header, cells)))
    return found


def write_report(path, lines):
    """The report's text; with ``path``, also written there under the run's stamp line, and its
    tables with the run's details to ``path`` with a ``.json`` suffix."""
    text = "\n".join(lines) + "\n"
    if path:
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        with open(path, "w") as fh:
            fh.write(run_stamp() + "\n\n" + text)
        with open(os.path.splitext(path)[0] + ".json", "w") as fh:
            json.dump({"run": run_info(), "tables": tables(lines)}, fh, indent=1)
    return text

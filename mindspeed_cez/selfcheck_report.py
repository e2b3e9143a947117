"""What ``python -m mindspeed_cez.selfcheck`` reports: the environment a bug report needs and the table."""

import importlib
import os
import platform

import torch
import torch.distributed as dist

import mindspeed_cez


def _version(dist_name):
    try:
        from importlib.metadata import version

        return version(dist_name)
    except Exception:  # noqa: BLE001 - not installed
        return None


def environment(device):
    """What a bug report needs: device, versions, world size."""
    info = {"device": str(device), "device_name": platform.processor() or platform.machine(),
            "python": platform.python_version(), "torch": torch.__version__, "mindspeed_cez": mindspeed_cez.__version__,
            "triton": None, "triton-ascend": _version("triton-ascend"), "torch_npu": _version("torch_npu"),
            "cann": None, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
            "world_size": dist.get_world_size() if dist.is_initialized() else 1}
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
    elif device.type == "npu":
        info["device_name"] = getattr(torch.npu, "get_device_name", lambda d: "npu")(device.index)
        try:
            info["cann"] = importlib.import_module("torch_npu.utils.collect_env").get_cann_version()
        except Exception:  # noqa: BLE001 - a torch_npu without the query
            pass
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info

def table(results):
    head = f"{'op':<36} {'backend':<22} {'dtype':<5} {'size: tokens x vocab':<20} {'loss':>8} {'z-loss':>8} " \
           f"{'grad':>8} {'ms':>8} {'torch ms':>8}  status"
    lines = [head, "-" * len(head)]
    for r in results:
        name = r["backend"] + (f"+{r['ce_backend']}" if r.get("ce_backend") else "") + ("*" if r.get("auto") else "")
        name += f" {r['grads']}" if r.get("grads") else ""
        e = r.get("errors", {})
        grad = max((v for k, v in e.items() if k in ("grad", "dhidden", "dweight")), default=None)
        cells = [f"{v:8.1e}" if v is not None else f"{'-':>8}" for v in (e.get("loss"), e.get("z_loss"), grad)]
        times = [f"{r[k]:8.2f}" if k in r else f"{'-':>8}" for k in ("ms", "torch_ms")]
        size = f"{r['size']} {r['rows']}x{r['vocab']}" + (f"/tp{r['tp']}" if r["tp"] > 1 else "")
        status = r["status"] + (f" ({r['reason']})" if r.get("reason") else "")
        lines.append(f"{r['op']:<36} {name:<22} {r['dtype']:<5} {size:<20} {' '.join(cells)} {' '.join(times)}  "
                     + status)
    return "\n".join(lines)

"""Bulk work, measured: `vlm batch` against the online server, and interactive latency while
a Batch API job runs on the same server.

    python -m bench.bulk_bench --model DIR [--pictures 2000] [--batch-requests 10000] \
        -- --device cuda --dtype bf16 --max-batch-size 64

Three phases, one machine, one run:

  online   caption128 on unique 800x600 pictures at 64 clients through gRPC
           (bench.load_gen --spawn): the online tokens a second
  offline  `vlm batch caption` over ``--pictures`` unique 800x600 pictures in a folder, with
           the same server flags: its tokens a second over the middle 90 % of its lines (the
           file is watched as it grows; start-up and the last stragglers left out)
  mixed    one server with ``--data-dir``: query3 on unique pictures at one client, idle;
           then a Batch API job of ``--batch-requests`` caption128 lines on unique pictures
           is uploaded and started, and once it runs the same query3 level again; the batch's
           lines a second meanwhile are read from its request counts. The job is cancelled
           at the end.

Writes bulk_bench.json (rows for bench.targets) and bulk_bench.png, and prints a table,
under ``--out`` (default bench/results/<device>/bulk/).
"""

from __future__ import annotations

import argparse
import base64
import json
import re
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.load_gen import REPO_ROOT, SpawnedServer, split_server_args
from bench.plotting import pyplot
from bench.synth_images import unique_images

SIZE = (800, 600)
CAPTION_BODY = {"length": "normal", "settings": {"temperature": 0, "max_tokens": 128}}
BATCH_SEED = 7  # the batch's pictures differ from every picture load_gen sends


def _py() -> list[str]:
    return [sys.executable]


def _env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def load_gen(args: list[str], out: Path, tag: str) -> dict[str, Any]:
    """One bench.load_gen run; its first row."""
    own = ["--out", str(out), "--tag", tag, "--quiet"]
    cut = args.index("--") if "--" in args else len(args)  # the server's flags come last
    cmd = [*_py(), "-m", "bench.load_gen", *args[:cut], *own, *args[cut:]]
    subprocess.run(cmd, check=True, env=_env(), cwd=REPO_ROOT)
    rows = json.loads((out / f"{tag}.json").read_text())["rows"]
    return rows[0]


def online(model: str, server_args: list[str], out: Path, requests: int) -> dict[str, Any]:
    row = load_gen(
        [
            "--spawn",
            "--scenario",
            "caption128:800x600:unique:c64",
            "--requests",
            str(requests),
            "--duration",
            "30",
            "--warmup",
            "8",
            "--",
            "--model",
            model,
            *server_args,
        ],
        out,
        "online_caption",
    )
    return {"tok_s": row["tokens_per_s"], "req_s": row["req_per_s"], "requests": row["requests"]}


def offline(model: str, server_args: list[str], out: Path, pictures: int) -> dict[str, Any]:
    folder = out / "pictures"
    folder.mkdir(parents=True, exist_ok=True)
    for i, data in enumerate(unique_images(*SIZE, range(1, pictures + 1), desc="pictures")):
        (folder / f"{i:06d}.jpg").write_bytes(data)
    results = out / "captions.jsonl"
    results.unlink(missing_ok=True)
    cmd = [*_py(), "-m", "vlm_server.cli", "batch", "caption", str(folder), "-o", str(results)]
    cmd += ["--max-tokens", "128", "--temperature", "0", "--model", model, *server_args]
    seen: list[tuple[float, int]] = []
    with open(out / "vlm_batch.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env())
        while proc.poll() is None:
            time.sleep(0.25)
            if results.exists():
                seen.append((time.monotonic(), results.read_bytes().count(b"\n")))
    if proc.returncode != 0:
        raise RuntimeError(f"vlm batch exited {proc.returncode}: see {out / 'vlm_batch.log'}")
    lines = [json.loads(raw) for raw in results.read_text().splitlines() if raw.strip()]
    tokens = [
        (r["response"] or {}).get("body", {}).get("metrics", {}).get("output_tokens", 0)
        for r in lines
    ]
    lo, hi = int(0.05 * len(lines)), int(0.95 * len(lines))
    t_lo = next(t for t, n in seen if n >= lo)
    t_hi = next(t for t, n in seen if n >= hi)
    return {
        "tok_s": sum(tokens[lo:hi]) / max(t_hi - t_lo, 1e-9),
        "req_s": (hi - lo) / max(t_hi - t_lo, 1e-9),
        "lines": len(lines),
        "failed": sum(1 for r in lines if (r["response"] or {}).get("status_code") != 200),
        "mean_tokens": sum(tokens) / max(len(tokens), 1),
    }


def _http(method: str, url: str, body: bytes | None = None, ctype: str = "") -> Any:
    headers = {"Content-Type": ctype} if ctype else {}
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


def _upload(base: str, path: Path) -> str:
    """POST /v1/files (multipart, purpose batch), streamed from ``path``; the file id."""
    boundary = uuid.uuid4().hex
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
        f'filename="{path.name}"\r\nContent-Type: application/jsonl\r\n\r\n'
    ).encode()
    tail = f"\r\n--{boundary}--\r\n".encode()
    body = head + path.read_bytes() + tail
    answer = _http("POST", f"{base}/files", body, f"multipart/form-data; boundary={boundary}")
    return answer["id"]


def batch_file(out: Path, n: int) -> Path:
    """The batch's input lines (kept: a later run with the same count reuses them)."""
    path = out / "batch_input.jsonl"
    if path.exists() and path.read_bytes().count(b"\n") == n:
        return path
    pictures = unique_images(*SIZE, range(1, n + 1), seed=BATCH_SEED, desc="batch pictures")
    with path.open("w") as f:
        for i, data in enumerate(pictures):
            url = "data:image/jpeg;base64," + base64.b64encode(data).decode()
            body = {"image_url": url, **CAPTION_BODY}
            line = {"custom_id": f"c{i}", "method": "POST", "url": "/v1/caption", "body": body}
            f.write(json.dumps(line) + "\n")
    return path


def mixed(
    model: str, server_args: list[str], out: Path, n_batch: int, queries: int
) -> dict[str, Any]:
    data_dir = out / "data"
    inputs = batch_file(out, n_batch)
    flags = ["--model", model, *server_args, "--data-dir", str(data_dir)]
    flags += ["--max-batch-file-bytes", str(inputs.stat().st_size + (1 << 20))]
    query = ["--scenario", "query3:800x600:unique:c1", "--requests", str(queries)]
    query += ["--duration", "60", "--warmup", "4"]
    with SpawnedServer(flags, out / "mixed_server.log", http=True) as server:
        assert server.http_url is not None
        where = ["--target", server.target, "--metrics-url", server.metrics_url]
        idle = load_gen([*where, *query, "--seed", "1"], out, "query_idle")
        file_id = _upload(server.http_url, inputs)
        batch = _http(
            "POST",
            f"{server.http_url}/batches",
            json.dumps(
                {"input_file_id": file_id, "endpoint": "/v1/caption", "completion_window": "24h"}
            ).encode(),
            "application/json",
        )
        url = f"{server.http_url}/batches/{batch['id']}"
        while (state := _http("GET", url))["request_counts"]["completed"] < min(64, n_batch // 10):
            if state["status"] in ("failed", "cancelled", "completed"):
                raise RuntimeError(f"the batch ended early: {state}")
            time.sleep(0.5)
        t0, done0 = time.monotonic(), state["request_counts"]["completed"]
        busy = load_gen([*where, *query, "--seed", "2"], out, "query_under_batch")
        state = _http("GET", url)
        t1, done1 = time.monotonic(), state["request_counts"]["completed"]
        _http("POST", f"{url}/cancel", b"{}", "application/json")
    return {
        **server_breakdown(out / "mixed_server.log"),
        "idle_p50_ms": idle["e2e_p50_ms"],
        "busy_p50_ms": busy["e2e_p50_ms"],
        "idle_p99_ms": idle["e2e_p99_ms"],
        "busy_p99_ms": busy["e2e_p99_ms"],
        "ratio": busy["e2e_p50_ms"] / idle["e2e_p50_ms"],
        "batch_req_s": (done1 - done0) / max(t1 - t0, 1e-9),
        "batch_status": state["status"],
    }


BREAKDOWN = ("queue_ms", "prefix_wait_ms", "prefill_ms", "decode_ms")


def server_breakdown(log: Path) -> dict[str, float]:
    """Medians of the server's own timings of the interactive queries (its access log),
    before the batch's first line and after: where the added latency goes."""
    phases: dict[str, list[dict[str, float]]] = {"idle": [], "busy": []}
    busy = False
    for line in log.read_text(errors="replace").splitlines():
        if "door=batch" in line:
            busy = True
        if "msg=request" in line and "task=query" in line and "door=grpc" in line:
            fields = dict(re.findall(r"(\w+)=([\d.]+)(?=\s|$)", line))
            phases["busy" if busy else "idle"].append(
                {k: float(fields.get(k, "nan")) for k in BREAKDOWN}
            )
    out = {}
    for phase, got in phases.items():
        for key in BREAKDOWN:
            values = sorted(r[key] for r in got)
            out[f"{phase}_server_{key}_p50"] = values[len(values) // 2] if values else float("nan")
    return out


def rows(d: dict[str, Any], prefix: str, commit: str | None) -> list[dict[str, Any]]:
    """targets.json rows of a bulk_bench.json."""
    from bench.targets import make_row, server_flags

    flags = server_flags(d.get("server_args") or [])
    out = []
    if d.get("offline") and d.get("online"):
        out.append(make_row(prefix, "batch.caption128.tok_s", d["offline"]["tok_s"], commit, flags))
        out.append(
            make_row(prefix, "caption128.unique.c64.tok_s", d["online"]["tok_s"], commit, flags)
        )
        ratio = d["offline"]["tok_s"] / d["online"]["tok_s"]
        out.append(make_row(prefix, "batch.caption128.online_ratio", ratio, commit, flags))
    if d.get("mixed"):
        m = d["mixed"]
        for name, key in (
            ("query3.unique.c1.p50_ms_idle_server", "idle_p50_ms"),
            ("query3.unique.c1.p50_ms_under_batch", "busy_p50_ms"),
        ):
            out.append(make_row(prefix, name, m[key], commit, flags))
        out.append(make_row(prefix, "query3.under_batch.p50_ratio", m["ratio"], commit, flags))
    return out


def plot(d: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        print("matplotlib is not installed: no plot")
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    if d.get("online") and d.get("offline"):
        a.bar(["online c64", "vlm batch"], [d["online"]["tok_s"], d["offline"]["tok_s"]])
        a.set_ylabel("caption tokens / s")
        a.set_title("caption128, unique 800x600")
    if d.get("mixed"):
        m = d["mixed"]
        b.bar(["idle", "under batch"], [m["idle_p50_ms"], m["busy_p50_ms"]])
        b.set_ylabel("query3 p50 (ms), one client")
        b.set_title(f"interactive under a batch ({m['ratio']:.2f}x)")
    fig.suptitle(d.get("device", ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def device_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return "cpu"


def main(argv: Sequence[str] | None = None) -> int:
    own, server_args = split_server_args(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="bench.bulk_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--pictures", type=int, default=2000)
    ap.add_argument("--online-requests", type=int, default=2000)
    ap.add_argument("--batch-requests", type=int, default=10000)
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--phases", nargs="+", default=["online", "offline", "mixed"])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(own)
    device = device_name()
    out = args.out or REPO_ROOT / "bench" / "results" / device.replace(" ", "_") / "bulk"
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"device": device, "server_args": server_args}
    if "online" in args.phases:
        result["online"] = online(args.model, server_args, out, args.online_requests)
    if "offline" in args.phases:
        result["offline"] = offline(args.model, server_args, out, args.pictures)
    if "mixed" in args.phases:
        result["mixed"] = mixed(args.model, server_args, out, args.batch_requests, args.queries)
    (out / "bulk_bench.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "bulk_bench.png")
    print(f"\nbulk work on {device}")
    for phase in ("online", "offline", "mixed"):
        if phase in result:
            cells = (f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in result[phase].items())  # fmt: skip
            print(f"  {phase:8s} " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A user's try of ``ProcessBatcher`` on a model no test contains: BERT-base (``transformers``' default
``BertConfig``, random weights, 110 M parameters) with three int64 inputs, built by ``trtc build --engine none``
at defaults, served by ONNX Runtime on the CPU to client threads in spawned processes with mixed sequence
lengths (16, 64, 128). Checks every answer against ``engines(x)`` and reports the peaks of memory: this
process (the build, then serving), and each client process's own (``VmHWM``: ``ru_maxrss`` of a spawned
child also counts the parent's pages at the fork before its exec).

    python benchmarks/process_batcher_bert.py --out benchmarks/results/process_batcher_bert.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


class Bert:
    """BERT-base from its default config, returning the pooled output (a factory for ``--model-factory``)."""

    def __new__(cls) -> Any:
        import torch
        from transformers import BertConfig, BertModel

        class Pooled(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                torch.manual_seed(0)
                self.bert = BertModel(BertConfig())

            def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
                return self.bert(input_ids=input_ids, attention_mask=attention_mask,
                                 token_type_ids=token_type_ids).pooler_output

        return Pooled().eval()


def _own_peak_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1024


def _client(handle: Any, seed: int, threads: int, each: int, out: Any) -> None:
    client = handle.connect()
    rng = np.random.default_rng(seed)
    sent: list[tuple[dict[str, np.ndarray], Any]] = []
    lock = threading.Lock()

    def one() -> None:
        for _ in range(each):
            with lock:
                s = int(rng.choice([16, 64, 128]))
                feed = {"input_ids": rng.integers(0, 30000, (1, s)).astype(np.int64),
                        "attention_mask": np.ones((1, s), np.int64),
                        "token_type_ids": rng.integers(0, 2, (1, s)).astype(np.int64)}
            answer = client.submit(feed, timeout=120)
            with lock:
                sent.append((feed, answer))

    workers = [threading.Thread(target=one) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    out.put((sent, _own_peak_mib()))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("build/process-batcher-bert"))
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--requests", type=int, default=10, help="Per client thread.")
    args = parser.parse_args()

    from benchmarks.serving_gpu import _trtc
    from compiler.cli import cli

    started = time.perf_counter()
    _trtc(cli, ["build", "--model-factory", "benchmarks.process_batcher_bert:Bert", "--input", "input_ids:BxS:int64",
                "--input", "attention_mask:BxS:int64", "--input", "token_type_ids:BxS:int64[0,2)",
                "--dim", "S=1:64:128", "--buckets", "1,8,16", "--engine", "none", "--out", str(args.work),
                "--force", "-q"])
    build_s = time.perf_counter() - started
    build_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    import compiler
    from compiler.serve.processes import ProcessBatcher

    engines = compiler.load(args.work, backend="onnxruntime", device="cpu", contexts=1)
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    begin = time.perf_counter()
    with ProcessBatcher(engines, max_wait_ms=5) as batcher:  # defaults otherwise
        procs = [spawn.Process(target=_client, args=(batcher.client_handle(args.threads), p, args.threads,
                                                     args.requests, results)) for p in range(args.processes)]
        for p in procs:
            p.start()
        reports = [results.get(timeout=900) for _ in procs]
        for p in procs:
            p.join()
    serve_s = time.perf_counter() - begin
    worst = 0.0
    answered = 0
    for sent, _ in reports:
        for feed, answer in sent:
            ref = engines(feed)
            worst = max(worst, max(float(np.abs(ref[k] - answer[k]).max()) for k in ref))
            answered += 1
    report = {"kind": "trtc-process-batcher-bert", "command": " ".join(sys.argv), "build_seconds": round(build_s, 1),
              "build_peak_mib": round(build_peak), "requests": answered, "serve_seconds": round(serve_s, 1),
              "max_abs_vs_engines": worst, "process_peak_mib": round(_own_peak_mib()),  # build and serving
              "client_peak_mib": round(max(peak for _, peak in reports))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

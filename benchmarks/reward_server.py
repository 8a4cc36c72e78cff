"""A minimal reward server for DigenRL's ``remote`` reward: copy it, replace :func:`score`.

Standard library ``http.server`` (+ numpy and Pillow to decode images). Run::

    python benchmarks/reward_server.py --port 8000

and point a run at it::

    reward:
      components:
        - {name: remote, args: {url: "http://127.0.0.1:8000/score", timeout: 60, retries: 2, batch_size: 32}}

The payload (docs/remote_reward.md): a POST of JSON ``{"format", "prompts", "metadata", "images"}``;
the answer ``{"scores": [one float per sample], "info": [optional dict per sample]}``.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

import numpy as np

ScoreFn = Callable[[list[np.ndarray], list[str], list[dict]], list[float]]


def decode_images(payload: dict) -> list[np.ndarray]:
    """The payload's images as float32 arrays in [0, 1]: (C, H, W) per image, (C, F, H, W) per video."""
    images = payload["images"]
    if payload["format"] == "array":
        raw = np.frombuffer(base64.b64decode(images["data"]), dtype="<f4")
        return list(raw.reshape(images["shape"]))
    return [_decode_png_list(item) if isinstance(item, list) else _decode_png(item) for item in images]


def _decode_png(b64: str) -> np.ndarray:
    from PIL import Image

    arr = np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))), dtype=np.float32) / 255.0
    return arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)


def _decode_png_list(frames: list[str]) -> np.ndarray:
    return np.stack([_decode_png(f) for f in frames], axis=1)  # (C, F, H, W)


def score(images: list[np.ndarray], prompts: list[str], metadata: list[dict]) -> list[float]:
    """The example: mean brightness. Replace with your model (GenEval, OCR, a VLM judge, ...)."""
    return [float(img.mean()) for img in images]


def make_server(score_fn: ScoreFn = score, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    """A threaded server answering POSTs with ``score_fn``'s scores (port 0: any free port)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            try:
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                images = decode_images(payload)
                scores = score_fn(images, payload["prompts"], payload["metadata"])
                body, status = json.dumps({"scores": [float(s) for s in scores]}).encode(), 200
            except Exception as exc:  # a failed request answers 500 with the reason; the server keeps serving
                body, status = f"{type(exc).__name__}: {exc}".encode(), 500
            self.send_response(status)
            self.send_header("Content-Type", "application/json" if status == 200 else "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # quiet
            pass

    return ThreadingHTTPServer((host, port), Handler)


def serve_in_thread(server: ThreadingHTTPServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return thread


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    srv = make_server(score, args.host, args.port)
    print(f"reward server on http://{args.host}:{srv.server_address[1]}/score", flush=True)
    srv.serve_forever()

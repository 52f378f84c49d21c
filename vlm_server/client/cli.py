"""``vlm-client``: call a running server from the command line.

    vlm-client caption photo.jpg --stream
    vlm-client query photo.jpg "what colour is the car?" [--choices red,blue] [--regex ...]
    vlm-client detect photo.jpg car --json
    vlm-client point photo.jpg car --draw points.png
    vlm-client segment photo.jpg dog --draw out.png
    vlm-client encode photo.jpg          # prints an id usable as IMAGE: id:<image id>
    vlm-client info

IMAGE is a file, ``sample`` for the bundled sample picture, or ``id:<image id>`` from
``encode``; ``query`` also takes ``none``. The server is ``--target host:port`` (or
VLM_TARGET; default localhost:50051); ``--api-key`` (VLM_API_KEY) and ``--tls`` /
``--ca-cert`` / ``--client-cert`` / ``--client-key`` for servers that require them.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from vlm_server.client import draw
from vlm_server.client.security import Security
from vlm_server.client.sync import DEFAULT_TARGET, VisionLanguageClient
from vlm_server.client.types import EncodedImage, TextDelta, TextResult, VlmError

SAMPLE = "sample"
NO_IMAGE = "none"
ID_PREFIX = "id:"


def _common(parser: argparse.ArgumentParser, suppress: bool) -> None:
    # Accepted before and after the command; after it, a flag only counts when given.
    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    parser.add_argument(
        "--target",
        default=default(os.environ.get("VLM_TARGET", DEFAULT_TARGET)),
        help="server address host:port [VLM_TARGET]",
    )
    parser.add_argument(
        "--timeout", type=float, default=default(None), help="deadline of the call in seconds"
    )
    parser.add_argument(
        "--json", action="store_true", default=default(False), help="print the result as JSON"
    )
    parser.add_argument(
        "--api-key",
        default=default(os.environ.get("VLM_API_KEY")),
        help="sent as 'authorization: Bearer KEY' [VLM_API_KEY]",
    )
    parser.add_argument(
        "--tls", action="store_true", default=default(False), help="connect over TLS"
    )
    parser.add_argument(
        "--ca-cert",
        default=default(os.environ.get("VLM_CA_CERT")),
        help="PEM CA of the server's certificate (implies --tls; default: system roots) "
        "[VLM_CA_CERT]",
    )
    parser.add_argument("--client-cert", default=default(None), help="PEM, for mutual TLS")
    parser.add_argument("--client-key", default=default(None), help="PEM, for mutual TLS")


def _settings(parser: argparse.ArgumentParser, objects: bool) -> None:
    if objects:
        parser.add_argument("--max-objects", type=int, help="most objects to return")
        return
    parser.add_argument("--temperature", type=float, help="0 = greedy (server default 0.5)")
    parser.add_argument("--top-p", type=float, help="nucleus mass in (0, 1]")
    parser.add_argument("--max-tokens", type=int, help="most tokens to generate")
    parser.add_argument("--seed", type=int, help="sampler seed")
    parser.add_argument("--stream", action="store_true", help="print text as it arrives")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vlm-client", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _common(parser, suppress=False)
    common = argparse.ArgumentParser(add_help=False)
    _common(common, suppress=True)
    sub = parser.add_subparsers(dest="command", required=True)

    cap = sub.add_parser("caption", parents=[common], help="describe an image")
    cap.add_argument("image")
    cap.add_argument("--length", default="normal", choices=["short", "normal", "long"])
    _settings(cap, objects=False)

    query = sub.add_parser("query", parents=[common], help="ask a question")
    query.add_argument("image", help=f"as for caption, or '{NO_IMAGE}'")
    query.add_argument("question")
    query.add_argument("--choices", help="comma-separated answers to choose from")
    query.add_argument("--regex", help="the answer must fully match this pattern")
    _settings(query, objects=False)

    for name, text in (
        ("point", "point at objects"),
        ("detect", "find boxes"),
        ("segment", "outline an object"),
    ):
        p = sub.add_parser(name, parents=[common], help=text)
        p.add_argument("image")
        p.add_argument("object")
        p.add_argument(
            "--draw",
            type=Path,
            metavar="OUT.png",
            help="save the image with the result drawn on it",
        )
        _settings(p, objects=True)

    enc = sub.add_parser("encode", parents=[common], help="upload an image; print its id")
    enc.add_argument("image")
    sub.add_parser("info", parents=[common], help="show the served model and limits")
    return parser


def _image_input(spec: str) -> bytes | EncodedImage | None:
    if spec == NO_IMAGE:
        return None
    if spec.startswith(ID_PREFIX):
        return EncodedImage(spec[len(ID_PREFIX) :], 0, 0, 0)
    if spec == SAMPLE and not Path(spec).exists():
        from image_pipeline import sample_image_bytes

        return sample_image_bytes()
    return Path(spec).read_bytes()


def _settings_of(args: argparse.Namespace) -> dict[str, Any]:
    names = ("temperature", "top_p", "max_tokens", "max_objects", "seed")
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def _print_json(value: Any) -> None:
    print(json.dumps(dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value))


def _text(
    client: VisionLanguageClient, args: argparse.Namespace, image: bytes | EncodedImage | None
) -> None:
    settings = _settings_of(args)
    if args.command == "caption":
        if image is None:
            raise SystemExit("vlm-client: caption needs an image")
        events = client.caption_stream(image, args.length, timeout=args.timeout, **settings)
    else:
        choices = args.choices.split(",") if args.choices else None
        events = client.query_stream(
            image,
            args.question,
            choices=choices,
            regex=args.regex,
            timeout=args.timeout,
            **settings,
        )
    for event in events:
        if isinstance(event, TextDelta):
            if args.stream and not args.json:
                print(event.text, end="", flush=True)
            continue
        assert isinstance(event, TextResult)
        if args.json:
            _print_json(event)
        elif args.stream:
            print()
        else:
            print(event.text)


def _regions(
    client: VisionLanguageClient, args: argparse.Namespace, image: bytes | EncodedImage
) -> None:
    settings = _settings_of(args)
    fn = {"point": client.point, "detect": client.detect, "segment": client.segment}
    result = fn[args.command](image, args.object, timeout=args.timeout, **settings)
    if args.draw is not None:
        if not isinstance(image, bytes):
            raise SystemExit("vlm-client: --draw needs the image itself, not an id")
        picture = Image.open(io.BytesIO(image))
        if args.command == "segment":
            drawn = draw.render(
                picture, boxes=[result.box], polygons=result.polygons, mask=result.mask
            )
        else:
            drawn = draw.render(
                picture, points=getattr(result, "points", ()), boxes=getattr(result, "boxes", ())
            )
        drawn.save(args.draw)
    if args.json:
        _print_json(result)
        return
    if args.command == "point":
        for p in result.points:
            print(f"x={p.x:.4f} y={p.y:.4f}")
        print(f"({len(result.points)} points, finish: {result.finish_reason})")
    elif args.command == "detect":
        for b in result.boxes:
            print(
                f"x_min={b.x_min:.4f} y_min={b.y_min:.4f} x_max={b.x_max:.4f} y_max={b.y_max:.4f}"
            )
        print(f"({len(result.boxes)} boxes, finish: {result.finish_reason})")
    else:
        b = result.box
        print(
            f"box x_min={b.x_min:.4f} y_min={b.y_min:.4f} x_max={b.x_max:.4f} y_max={b.y_max:.4f}"
        )
        print(f"path {result.svg_path}")
        print(
            f"({len(result.polygons)} polygons, mask {result.mask.height}x"
            f"{result.mask.width}, finish: {result.finish_reason})"
        )
    if args.draw is not None:
        print(f"drawn to {args.draw}", file=sys.stderr)


def _security(args: argparse.Namespace) -> Security:
    return Security(
        api_key=args.api_key,
        tls=args.tls,
        ca_cert=args.ca_cert,
        client_cert=args.client_cert,
        client_key=args.client_key,
    )


def _run(args: argparse.Namespace) -> None:
    security = _security(args)
    with VisionLanguageClient(args.target, timeout=args.timeout, security=security) as client:
        if args.command == "info":
            info = client.model_info(timeout=args.timeout)
            if args.json:
                _print_json(info)
            else:
                for key, value in dataclasses.asdict(info).items():
                    print(f"{key}: {value}")
            return
        image = _image_input(args.image)
        if args.command == "encode":
            if not isinstance(image, bytes):
                raise SystemExit("vlm-client: encode needs an image file")
            encoded = client.encode_image(image, timeout=args.timeout)
            if args.json:
                _print_json(encoded)
            else:
                print(f"{ID_PREFIX}{encoded.image_id}")
        elif args.command in ("caption", "query"):
            _text(client, args, image)
        else:
            if image is None:
                raise SystemExit(f"vlm-client: {args.command} needs an image")
            _regions(client, args, image)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``vlm-client``; returns the exit code (1: the call failed)."""
    args = build_parser().parse_args(argv)
    try:
        _run(args)
    except VlmError as err:
        field = f" (field: {err.field})" if err.field else ""
        print(f"vlm-client: {err}{field}", file=sys.stderr)
        return 1
    except OSError as err:
        print(f"vlm-client: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""docs/configuration.md, rendered from the option table."""

from __future__ import annotations

from vlm_server.options.cluster import CLUSTER_OPTIONS
from vlm_server.options.spec import Group, Option
from vlm_server.options.table import OPTIONS

COMMAND = "python -m vlm_server.options --markdown > docs/configuration.md"

_HEAD = f"""# Configuration

Generated from the option table (`vlm_server/options/table.py`) by `{COMMAND}`;
do not edit it by hand (a test fails when it is stale).

Every option of `vlm-server` (and `vlm serve`) is a command-line flag and a `VLM_*` environment
variable: `--max-batch-size 16` or `VLM_MAX_BATCH_SIZE=16`. A flag wins over the environment,
the environment over the default. Sizes accept suffixes (`512KiB`, `32MiB`, `2G`). A bad value
stops the server at start with an error naming the flag or variable.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


_CLUSTER = """
## Cluster

`vlm cluster` (Ray Serve, [deployment.md](deployment.md#many-gpus-and-hosts-ray-serve)) takes
every option above, for each replica (its ports are the cluster's: `--port` and `--http-port`
are the gateway's doors, or Ray Serve's gRPC and HTTP proxies with `--ingress ray`), and these;
`vlm gateway` takes the same:

"""

_TABLE_HEAD = "| Flag | Environment variable | Default | Meaning |\n|---|---|---|---|\n"


def _rows(options: tuple[Option, ...] | list[Option]) -> str:
    rows = []
    for opt in options:
        meaning = _cell(opt.help + opt.choices_text)
        default = _cell(opt.shown_default)
        rows.append(f"| `{opt.flag}` | `{opt.env}` | `{default}` | {meaning} |\n")
    return "".join(rows)


def render() -> str:
    """The whole document."""
    parts = [_HEAD]
    for group in Group:
        parts.append(f"\n## {group.title}\n\n{group.description}\n\n")
        parts.append(_TABLE_HEAD + _rows([opt for opt in OPTIONS if opt.group is group]))
    parts.append(_CLUSTER + _TABLE_HEAD + _rows(CLUSTER_OPTIONS))
    return "".join(parts)

"""`tokenmill route` flags of a canary rollout (light: imported when the CLI registers)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .canary import CanaryConfig


def add_arguments(p: Any) -> None:
    """``tokenmill route`` flags of a canary rollout."""
    g = p.add_argument_group("canary rollout")
    g.add_argument("--variant", action="append", default=[], metavar="NAME=URL[,URL]",
                   help="a named group of backends; the first is the base (rollback target), e.g. "
                        "--variant base=http://a:8000 --variant int4=http://b:8000")
    g.add_argument("--split", action="append", default=[], metavar="NAME=PERCENT",
                   help="traffic share of a canary variant, e.g. int4=10; the base takes the rest")
    g.add_argument("--slo", default=None, metavar="KEY=VALUE,...",
                   help="guard: roll a canary back to 0%% when it breaks any of ttft_p99=S, tpot_p99=S, "
                        "e2e_p99=S (whole request; non-streamed answers have only this), error_rate=F over window=S seconds with at least min_samples=N requests")
    g.add_argument("--split-state", default=None, metavar="PATH",
                   help="JSON file that keeps the split across restarts")
    g.add_argument("--admin-key", default=None,
                   help="key for POST /admin/split (default: --api-key; none: loopback clients only)")
    g.add_argument("--k8s-httproute", default=None, metavar="[NAMESPACE/]NAME",
                   help="HTTPRoute whose backendRef weights follow the split (needs a ServiceAccount "
                        "allowed to get/update httproutes; otherwise a rollback only alerts)")
    g.add_argument("--k8s-backend-ref", action="append", default=[], metavar="VARIANT=NAME",
                   help="backendRef (InferencePool) name of a variant in that HTTPRoute (default: its name)")


def config_from_args(args: Any) -> "CanaryConfig | None":
    """The CanaryConfig of parsed args, None without --variant; ValueError on bad input."""
    from .canary import CanaryConfig
    from .guard import SLO
    from .variants import parse_split, parse_variant

    if not getattr(args, "variant", None):
        if getattr(args, "split", None) or getattr(args, "slo", None):
            raise ValueError("--split and --slo need --variant groups")
        return None
    refs = {}
    for entry in args.k8s_backend_ref:
        k, sep, v = entry.partition("=")
        if not sep or not k.strip() or not v.strip():
            raise ValueError(f"--k8s-backend-ref wants VARIANT=NAME, got {entry!r}")
        refs[k.strip()] = v.strip()
    return CanaryConfig(variants=[parse_variant(v) for v in args.variant], split=parse_split(args.split),
                        slo=SLO.parse(args.slo) if args.slo else SLO(), state_file=args.split_state,
                        admin_key=args.admin_key, k8s_httproute=args.k8s_httproute, k8s_backend_refs=refs)

"""The proxy's flags are walked from ProxySettings: one per field, each with its help, in
its group."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from appliance import modelflags
from appliance.proxy import settings
from appliance.proxy.settings import ProxySettings, build_parser, load_settings


def _leaves(model: type[BaseModel], path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            out += _leaves(kind, (*path, name))
        else:
            out.append((*path, name))
    return out


def test_every_field_has_exactly_one_flag_and_a_description() -> None:
    walked = list(modelflags.options(ProxySettings))
    assert sorted(o.path for o in walked) == sorted(_leaves(ProxySettings))
    assert all(o.field.description for o in walked), [o.option for o in walked
                                                       if not o.field.description]
    parser = build_parser()
    by_dest: dict[str, list[str]] = {}
    for action in parser._actions:
        by_dest.setdefault(action.dest, []).extend(action.option_strings)
    for o in walked:  # one flag (with its --no- form for a boolean) per field
        names = by_dest.pop(o.dest)
        assert [n for n in names if not n.startswith("--no-")] == [o.option]
    assert set(by_dest) == {"help", "config"}


def test_help_lists_the_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # one line per flag: argparse wraps at the terminal
    text = build_parser().format_help()
    groups = [settings.LISTENER, settings.NODES, "kubernetes discovery", settings.TIMEOUTS,
              settings.ADMISSION, settings.PLACEMENT, settings.PREFIX, settings.TRACING,
              settings.SECURITY, settings.TLS, settings.LOGGING]
    at = [text.index(f"\n{g}:\n") for g in groups]
    assert at == sorted(at)
    assert "--itl-slo-ms MS" in text and "(default: 3x D's measured time per token)" in text
    assert "--prefix-index, --no-prefix-index" in text
    assert "also $APPLIANCE_PROXY_API_KEYS, comma-separated" in text


def test_flags_merge_into_the_files_tables(tmp_path: Path) -> None:
    cfg = tmp_path / "proxy.toml"
    cfg.write_text('discovery = "kubernetes"\n[kubernetes]\nnamespace = "pd"\n'
                   'prefill_selector = "a=p"\ndecode_selector = "a=d"\nprefill_port = 9\n')
    s = load_settings(["--config", str(cfg), "--k8s-api-server", "http://k:1",
                       "--k8s-prefill-port", "10", "--kv-events-resync", "2.5",
                       "--bootstrap-token", "t"], environ={})
    k = s.kubernetes
    assert (k.namespace, k.prefill_selector, k.prefill_port, k.api_server) == \
        ("pd", "a=p", 10, "http://k:1")
    assert (s.kv_events_resync_s, s.bootstrap_token) == (2.5, "t")


def test_unset_flags_leave_the_defaults() -> None:
    assert load_settings([], environ={}) == ProxySettings()

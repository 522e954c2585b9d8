"""`edgeserve ps`: what a running server holds: its model names, requests, and KV pool."""

from __future__ import annotations

import json

import click

from edgeserve.errors import EdgeserveError


def server_state(url: str, api_key: str | None) -> dict:
    """The model names (and which are loaded), request counts and KV pool use of the edgeserve server at url."""
    import httpx

    url = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=10) as http:
            models = http.get("/v1/models")
            health = http.get("/health")
            kv = http.get("/v1/edgeserve/kv")
    except httpx.HTTPError as exc:
        raise EdgeserveError(f"no server answers at {url}: {exc}") from None
    if models.status_code != 200:
        raise EdgeserveError(f"{url}/v1/models answered {models.status_code}: {models.text[:200]}")
    data = models.json()["data"]
    answer = health.json() if health.headers.get("content-type", "").startswith("application/json") else {}
    state = {"url": url, "models": [m["id"] for m in data], "loaded": [m["id"] for m in data if m.get("loaded", True)],
             "max_model_len": next((m["max_model_len"] for m in data if "max_model_len" in m), None),
             **{k: answer.get(k) for k in ("status", "running", "waiting")}}
    if kv.status_code == 200:
        pool = kv.json()
        state["kv"] = {"block_size": pool["block_size"], "blocks": pool["num_blocks"], **pool["counts"]}
    return state


@click.command("ps")
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, help="The server's address.")
@click.option("--api-key", envvar="EDGESERVE_API_KEY", default=None, help="API key of the server.")
@click.option("--json", "json_out", is_flag=True, help="Print the state as JSON.")
def ps(url: str, api_key: str | None, json_out: bool) -> None:
    """Show what a running `edgeserve serve` holds: model names, running and waiting requests, KV pool use."""
    try:
        state = server_state(url, api_key)
    except EdgeserveError as exc:
        if not json_out:
            raise
        click.echo(json.dumps({"error": {"message": str(exc)}}))  # scripts read stdout: the error is JSON too
        raise SystemExit(1) from None
    if json_out:
        click.echo(json.dumps(state, indent=1))
        return
    rows = [("server", f"{state['url']} ({state.get('status') or 'unknown'})"),
            ("models", ", ".join(m if m in state["loaded"] else f"{m} (not loaded)" for m in state["models"])),
            ("context", f"{state['max_model_len']} tokens" if state["max_model_len"] else "none loaded"),
            ("requests", f"{state.get('running')} running, {state.get('waiting')} waiting")]
    if kv := state.get("kv"):
        held = kv["used"] + kv["shared"]
        rows.append(("KV pool", f"{kv['blocks']} blocks x {kv['block_size']} tokens: {held} held by requests "
                                f"({kv['used']} used, {kv['shared']} shared), {kv['cached']} cached, {kv['free']} free"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        click.echo(f"{key:>{width}}  {value}")

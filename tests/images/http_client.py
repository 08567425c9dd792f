"""An HTTP client the image tests run inside a container's network namespace (`oci_run.in_netns`).

python http_client.py wait URL TIMEOUT_S        exits 0 once URL answers 200, 1 at the timeout
python http_client.py post URL BODY_JSON N      N concurrent POSTs; prints [{status, body}] as JSON
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx


def wait(url: str, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return 0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    print(f"{url} did not answer 200 within {timeout} s", file=sys.stderr)
    return 1


async def post(url: str, body: object, n: int) -> list[dict[str, object]]:
    async with httpx.AsyncClient(timeout=300) as client:

        async def one() -> dict[str, object]:
            resp = await client.post(url, json=body)
            try:
                payload: object = resp.json()
            except ValueError:
                payload = resp.text
            return {"status": resp.status_code, "body": payload}

        return list(await asyncio.gather(*(one() for _ in range(n))))


def main(argv: list[str]) -> int:
    if argv[0] == "wait":
        return wait(argv[1], float(argv[2]))
    if argv[0] == "post":
        print(json.dumps(asyncio.run(post(argv[1], json.loads(argv[2]), int(argv[3])))))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

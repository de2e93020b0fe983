"""A foreign producer that keeps going through server outages, with nats-py (NATS' Python
client) and no convoy stamps (no event id, no Nats-Msg-Id): rounds of KEYS messages, one per key
`key-<k>`, whose payload is the round number (the key's sequence number), each published to the
subject <topic>.<partition> convoy documents (convoy_partition.py) with JetStream's
acknowledgement awaited. A round that fails anywhere (no acknowledgement, no responders, a lost
connection) is published again whole, so a key's messages are never reordered (a re-sent message
is stored twice: a duplicate, never a gap). After each acknowledged round it prints `round <n>`
and sleeps PAUSE_MS; it stops between rounds once the file STOP exists, printing `done`.
Usage: URL TOPIC PARTITIONS KEYS PAUSE_MS STOP"""
import asyncio
import os
import sys

import nats

from convoy_partition import partition


async def main() -> None:
    url, topic, partitions, keys, pause_ms, stop = (
        sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])

    async def quiet(_e: Exception) -> None:
        pass

    nc = await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.2,
                            error_cb=quiet, disconnected_cb=None)
    js = nc.jetstream()
    round_ = 0
    failed, failures = -1, 0
    while not os.path.exists(stop):
        try:
            for k in range(keys):
                key = f"key-{k}"
                await js.publish(f"{topic}.{partition(key.encode(), partitions)}", str(round_).encode(),
                                 headers={"convoy-key": key}, timeout=2)
        except Exception as e:  # the server is away or refused: the whole round again
            failures = failures + 1 if failed == round_ else 1
            failed = round_
            if failures == 1 or failures % 25 == 0:
                print(f"round {round_} failed ({failures}x; {type(e).__name__}: {e}); sending it again",
                      file=sys.stderr, flush=True)
            await asyncio.sleep(0.2)
            continue
        print(f"round {round_}", flush=True)
        round_ += 1
        await asyncio.sleep(pause_ms / 1000)
    print("done", flush=True)
    await nc.close()


asyncio.run(main())

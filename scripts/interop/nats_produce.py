"""Produces probe messages with nats-py (NATS' Python client), placing each key on the partition
convoy documents (convoy_partition.py: Kafka's Java-compatible murmur2), published to the
subject <topic>.<partition> with the key in the `convoy-key` header and JetStream's
acknowledgement awaited. For each of KEYS keys, PER_KEY messages whose payload is the key's
sequence number, interleaved across keys. Usage: URL TOPIC PARTITIONS KEYS PER_KEY"""
import asyncio
import sys

import nats

from convoy_partition import partition


async def main() -> None:
    url, topic, partitions, keys, per_key = (
        sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    nc = await nats.connect(url)
    js = nc.jetstream()
    for seq in range(per_key):
        for k in range(keys):
            key = f"py-{k}"
            await js.publish(
                f"{topic}.{partition(key.encode(), partitions)}",
                str(seq).encode(),
                headers={"convoy-key": key, "Nats-Msg-Id": f"{key}-{seq}"},
            )
    # Printed for the test: the partition of each key, as nats-py computed it.
    print(" ".join(f"py-{k}={partition(f'py-{k}'.encode(), partitions)}" for k in range(keys)))
    await nc.close()


asyncio.run(main())

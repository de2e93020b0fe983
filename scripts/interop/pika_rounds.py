"""A foreign producer that keeps going through broker outages, with pika (RabbitMQ's Python
client) and no convoy stamps (no event id, no message_id): rounds of KEYS messages, one per key
`key-<k>`, whose payload is the round number (the key's sequence number). Each message is
published confirmed, persistent and mandatory to the partition convoy documents
(convoy_partition.py). A round that fails anywhere — a refused or unconfirmed publish, a lost
connection — is published again whole on a new connection, so a key's messages are never
reordered (a re-sent message is stored twice: a duplicate, never a gap). After each confirmed
round it prints `round <n>` and sleeps PAUSE_MS; it stops between rounds once the file STOP
exists, printing `done`. Usage: URI TOPIC PARTITIONS KEYS PAUSE_MS STOP"""
import os
import sys
import time

import pika

from convoy_partition import partition


def connect(uri: str):
    connection = pika.BlockingConnection(pika.URLParameters(uri))
    channel = connection.channel()
    channel.confirm_delivery()
    return connection, channel


def main() -> None:
    uri, topic, partitions, keys, pause_ms, stop = (
        sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    connection = channel = None
    round_ = 0
    failed, failures = -1, 0
    while not os.path.exists(stop):
        try:
            if channel is None or not channel.is_open:
                connection, channel = connect(uri)
            for k in range(keys):
                key = f"key-{k}".encode()
                channel.basic_publish(
                    exchange=topic,
                    routing_key=str(partition(key, partitions)),
                    body=str(round_).encode(),
                    mandatory=True,
                    properties=pika.BasicProperties(delivery_mode=2, headers={"convoy-key": key}),
                )
        except Exception as e:  # the broker is away or refused: the whole round again
            failures = failures + 1 if failed == round_ else 1
            failed = round_
            if failures == 1 or failures % 25 == 0:
                print(f"round {round_} failed ({failures}x; {type(e).__name__}: {e}); sending it again",
                      file=sys.stderr, flush=True)
            try:
                if connection is not None and connection.is_open:
                    connection.close()
            except Exception:
                pass
            connection = channel = None
            time.sleep(0.2)
            continue
        print(f"round {round_}", flush=True)
        round_ += 1
        time.sleep(pause_ms / 1000)
    print("done", flush=True)


main()

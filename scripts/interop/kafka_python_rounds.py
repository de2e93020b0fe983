"""A foreign producer that keeps going through broker outages, with kafka-python (its own
protocol code and Java-compatible murmur2 partitioner) and no convoy stamps (no event id): rounds
of KEYS messages, one per key `key-<k>`, whose payload is the round number (the key's sequence
number), each acknowledged by all in-sync replicas. A round that fails anywhere (a send not
acknowledged in time, no broker answering) is published again whole by a new producer, so a
key's messages are never reordered (a re-sent message is stored twice: a duplicate, never a
gap). After each acknowledged round it prints `round <n>` and sleeps PAUSE_MS; it stops between
rounds once the file STOP exists, printing `done`. PARTITIONS is taken for the same arguments
as the other rounds producers; Kafka's partitioner picks the partition.
Usage: BOOTSTRAP TOPIC PARTITIONS KEYS PAUSE_MS STOP"""
import os
import sys
import time

from kafka import KafkaProducer


def connect(bootstrap: str) -> KafkaProducer:
    return KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5, retries=3,
                         max_in_flight_requests_per_connection=1, request_timeout_ms=5000,
                         max_block_ms=5000)


def abandon(producer: KafkaProducer) -> None:
    """Closes the producer of a failed round without waiting for its sends (the round is sent
    again whole). kafka-python's close flushes first and raises when that times out, leaving its
    sender thread running (a late send of the old round could land after the next one) and its
    __del__ to try again, printing a traceback: the sender is stopped and the producer marked
    closed here instead."""
    try:
        producer.close(timeout=1)
    except Exception:
        if producer._sender is not None:
            producer._sender.force_close()
        producer._closed = True


def main() -> None:
    bootstrap, topic, _partitions, keys, pause_ms, stop = (
        sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    producer = None
    round_ = 0
    failed, failures = -1, 0
    while not os.path.exists(stop):
        try:
            if producer is None:
                producer = connect(bootstrap)
            sent = [producer.send(topic, key=f"key-{k}".encode(), value=str(round_).encode())
                    for k in range(keys)]
            for future in sent:
                future.get(timeout=10)
        except Exception as e:  # the broker is away or refused: the whole round again
            failures = failures + 1 if failed == round_ else 1
            failed = round_
            if failures == 1 or failures % 25 == 0:
                print(f"round {round_} failed ({failures}x; {type(e).__name__}: {e}); sending it again",
                      file=sys.stderr, flush=True)
            if producer is not None:
                abandon(producer)
            producer = None
            time.sleep(0.2)
            continue
        print(f"round {round_}", flush=True)
        round_ += 1
        time.sleep(pause_ms / 1000)
    print("done", flush=True)
    if producer is not None:
        abandon(producer)


main()

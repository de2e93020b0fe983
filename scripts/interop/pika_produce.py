"""Produces probe messages with pika (RabbitMQ's Python client), placing each key on the
partition convoy documents (convoy_partition.py: Kafka's Java-compatible murmur2), published to
the topic's exchange with the partition as routing key and the key in the `convoy-key` header. For each of KEYS keys, PER_KEY messages whose payload is the key's sequence
number, interleaved across keys. Usage: URI TOPIC PARTITIONS KEYS PER_KEY"""
import sys

import pika

from convoy_partition import partition


uri, topic, partitions, keys, per_key = (
    sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
connection = pika.BlockingConnection(pika.URLParameters(uri))
channel = connection.channel()
channel.confirm_delivery()
for seq in range(per_key):
    for k in range(keys):
        key = f"py-{k}".encode()
        channel.basic_publish(
            exchange=topic,
            routing_key=str(partition(key, partitions)),
            body=str(seq).encode(),
            mandatory=True,
            properties=pika.BasicProperties(delivery_mode=2, headers={"convoy-key": key}),
        )
# Printed for the test: the partition of each key, as pika computed it.
print(" ".join(f"py-{k}={partition(f'py-{k}'.encode(), partitions)}" for k in range(keys)))
connection.close()

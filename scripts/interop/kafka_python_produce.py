"""Produces probe messages with kafka-python (its own protocol code and Java-compatible
murmur2 partitioner): for each of KEYS keys, PER_KEY messages whose payload is the key's
sequence number, interleaved across keys. Usage: BOOTSTRAP TOPIC KEYS PER_KEY"""
import sys

from kafka import KafkaProducer

bootstrap, topic, keys, per_key = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
for seq in range(per_key):
    for k in range(keys):
        producer.send(topic, key=f"py-{k}".encode(), value=str(seq).encode())
producer.flush(timeout=60)
producer.close()

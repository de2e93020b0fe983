"""The partition convoy places a key on, on every broker: (murmur2(key) & 0x7fffffff) % partitions,
Kafka's Java-compatible murmur2 (what convoy_core::partitioner implements and every convoy
publisher documents). Shared by the foreign producers of the interoperability tests."""


def murmur2(data: bytes) -> int:
    seed, m, r = 0x9747B28C, 0x5BD1E995, 24
    h = (seed ^ len(data)) & 0xFFFFFFFF
    n = len(data) // 4
    for i in range(n):
        k = int.from_bytes(data[4 * i:4 * i + 4], "little")
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> r
        k = (k * m) & 0xFFFFFFFF
        h = (h * m) & 0xFFFFFFFF
        h ^= k
    tail = data[4 * n:]
    if len(tail) >= 3:
        h ^= tail[2] << 16
    if len(tail) >= 2:
        h ^= tail[1] << 8
    if len(tail) >= 1:
        h ^= tail[0]
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h


def partition(key: bytes, partitions: int) -> int:
    return (murmur2(key) & 0x7FFFFFFF) % partitions

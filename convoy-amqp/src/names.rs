//! The names convoy gives a topic's queues, locks and markers on RabbitMQ ([`crate::topology`]
//! says what each is). A leaf: configuration checks their length, topology declares them.

/// The partition queue of `group` for partition `p` of `topic`.
pub fn partition_queue(topic: &str, group: &str, p: u32) -> String {
    format!("{topic}.{group}.p{p}")
}

/// The lock whose holder owns that partition queue.
pub fn owner_lock(topic: &str, group: &str, p: u32) -> String {
    format!("{}.owner", partition_queue(topic, group, p))
}

/// The queue every member of `group` consumes: its consumer count is the number of members.
pub fn members_queue(group: &str) -> String {
    format!("convoy.{group}.members")
}

/// Token `j` of the members allowed one partition over the even share.
pub fn extra_token(group: &str, j: u32) -> String {
    format!("convoy.{group}.extra.{j}")
}

/// The routing key of partition `p`.
pub fn routing_key(p: u32) -> String {
    p.to_string()
}

/// The empty queue whose `x-max-length` records topic `topic`'s partition count.
pub fn partitions_marker(topic: &str) -> String {
    format!("convoy.topic.{topic}.partitions")
}

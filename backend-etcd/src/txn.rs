//! Transactions and reads shared by the acquire, release, clean-up and group commit.

use etcd_client::{
    Client, Compare, CompareOp, GetOptions, SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse,
    TxnResponse,
};
use fencelock_core::Error;

use crate::error::map;

/// Deletes `key` if it is still the incarnation created at `revision` (etcd #22082: a
/// late delete must never remove a newer key). Returns whether it deleted it.
pub(crate) async fn delete_incarnation(
    client: &Client,
    key: &str,
    revision: i64,
) -> Result<bool, Error> {
    let txn = Txn::new()
        .when([Compare::create_revision(key, CompareOp::Equal, revision)])
        .and_then([TxnOp::delete(key, None)]);
    Ok(client.kv_client().txn(txn).await.map_err(map)?.succeeded())
}

/// Sort options selecting the first-created key under a name.
pub(crate) fn first_created() -> GetOptions {
    GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, SortOrder::Ascend)
        .with_limit(1)
        .with_keys_only()
}

pub(crate) fn get_first(ops: &[TxnOpResponse], index: usize) -> Option<i64> {
    match ops.get(index) {
        Some(TxnOpResponse::Get(get)) => get.kvs().first().map(|kv| kv.create_revision()),
        _ => None,
    }
}

/// A nested transaction that runs `put` (of `key`) only if `key` does not exist, and
/// otherwise reads it: a put over a stale key of ours would keep that incarnation's
/// create revision (its token) and give it our value. [`stale_of`] reads the answer.
pub(crate) fn put_if_absent(key: &str, put: TxnOp) -> TxnOp {
    TxnOp::txn(
        Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, 0)])
            .and_then([put])
            .or_else([TxnOp::get(key, None)]),
    )
}

/// The create revision of the stale key of ours that kept a transaction made like
/// [`put_if_absent`] from putting (`None`: the put happened).
pub(crate) fn stale_of(response: &TxnResponse) -> Option<i64> {
    if response.succeeded() {
        return None;
    }
    match response.op_responses().first() {
        Some(TxnOpResponse::Get(get)) => get.kvs().first().map(|kv| kv.create_revision()),
        _ => None,
    }
}

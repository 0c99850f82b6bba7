//! Calls on every node at once, and when their answers decide: one node for a single
//! server, Sentinel and Cluster; N for Redlock, which needs a majority.
//! (The margin for clock drift every local deadline subtracts is core's
//! [`CLOCK_DRIFT`](fencelock_core::kit::CLOCK_DRIFT).)

use futures_util::StreamExt;
use futures_util::future::join_all;
use futures_util::stream::FuturesUnordered;

use crate::node::Node;

/// Runs `each` on every node at once and returns their results in node order. With one
/// server (every topology but Redlock) the one future is awaited in place: `join_all`'s
/// allocations and moves of the future showed in the client's CPU per lock. Dropping the
/// returned future drops every node's future, as `join_all` does.
pub(crate) async fn on_every_node<'a, F, Fut, T>(nodes: &'a [Node], each: F) -> Vec<T>
where
    F: Fn(&'a Node) -> Fut,
    Fut: std::future::Future<Output = T>,
{
    if let [node] = nodes {
        vec![each(node).await]
    } else {
        join_all(nodes.iter().map(each)).await
    }
}

/// How many of `answers` are not in yet.
pub(crate) fn pending<T>(answers: &[Option<T>]) -> usize {
    answers.iter().filter(|a| a.is_none()).count()
}

/// Runs `calls` at once and collects their outputs by position as they come, until
/// `settled` is true of the outputs in so far (`None`: not in yet) or all are in. The
/// calls still running then go on in a task on `runtime` until they end; their outputs
/// are dropped. Dropping the returned future drops every call.
pub(crate) async fn until_settled<T, F>(
    runtime: &tokio::runtime::Handle,
    calls: impl ExactSizeIterator<Item = F>,
    mut settled: impl FnMut(&[Option<T>]) -> bool,
) -> Vec<Option<T>>
where
    F: std::future::Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let mut answers: Vec<Option<T>> = std::iter::repeat_with(|| None).take(calls.len()).collect();
    let mut running: FuturesUnordered<_> = calls
        .enumerate()
        .map(|(i, call)| async move { (i, call.await) })
        .collect();
    while let Some((i, answer)) = running.next().await {
        answers[i] = Some(answer);
        if settled(&answers) {
            break;
        }
    }
    if !running.is_empty() {
        runtime.spawn(async move { while running.next().await.is_some() {} });
    }
    answers
}

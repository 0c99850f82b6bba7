//! The conformance suite: the contract of [`DistributedLock`](crate::DistributedLock), as
//! plain async functions.
//!
//! Every backend runs every case against real servers, one generated test per
//! (backend, case), through [`conformance_suite!`](crate::conformance_suite). Each case
//! takes `&dyn DistributedLock`, uses lock names under a random prefix per process run
//! (so runs never see each other's state), and panics with a message on violation. Cases
//! that depend on an optional property (FIFO order, waiter counts) check
//! [`capabilities`](crate::DistributedLock::capabilities) and test what is claimed.
//!
//! ```text
//! mod mem {
//!     fencelock_core::conformance_suite!(std::sync::Arc::new(fencelock_core::MemoryLock::new()));
//! }
//! ```

mod cancellation;
mod clients;
mod election;
mod exclusion;
mod expiry;
mod handoff;
mod names;
mod operators;
mod rwlock;
mod semaphore;
mod support;

pub use cancellation::{
    a_release_retried_after_a_dropped_one_is_not_a_loss, cancelled_acquires_leave_nothing,
    cancelled_grants_and_extensions_leave_nothing, dropped_guard_frees_promptly,
};
pub use clients::{
    exclusion_is_visible_across_clients, mutual_exclusion_across_clients,
    try_lock_races_across_clients,
};
pub use election::{
    campaigns_are_checked_and_cancellable, leadership_passes_when_the_leader_is_lost,
    observations_end_when_the_client_closes, observers_report_each_grant_once,
    observers_see_every_leader_in_order, one_leader_at_a_time,
};
pub use exclusion::{
    fifo_order, locks_are_not_reentrant, mutual_exclusion, release_is_idempotent,
    try_lock_under_contention, wait_timeout_is_honoured, with_lock_runs_and_releases,
};
pub use expiry::{
    a_guard_outlives_its_dropped_client, fixed_lease_expires_and_reports_loss,
    fixed_leases_can_be_extended, renewing_lease_outlives_its_duration,
    with_lock_cancels_work_on_loss,
};
pub use handoff::{
    cancelled_give_up_leaves_no_waiter, cancelled_release_frees_the_name,
    contended_fixed_lease_starts_at_grant, expiry_after_handoff_passes_the_turn_on,
};
pub use names::{invalid_input_is_rejected, odd_names_are_independent};
pub use operators::{
    acquires_racing_close_are_given_up, close_releases_and_refuses,
    list_finds_held_and_waited_names, revoke_takes_the_lock_from_its_holder,
};
pub use rwlock::{
    a_waiting_writer_is_not_starved, readers_share_and_writers_exclude,
    rw_requests_are_checked_and_cancellable,
};
pub use semaphore::{
    contended_fixed_lease_permits_start_at_grant, never_more_permits_than_the_limit,
    permits_come_back_when_a_lease_ends, semaphore_requests_are_checked_and_cancellable,
    tokens_grow_after_a_name_was_idle,
};
pub use support::unique_name;

/// How many rounds, each with a fresh first client, [`conformance_suite!`](crate::conformance_suite) runs of a case
/// that closes that client ([`acquires_racing_close_are_given_up`]).
pub const ROUNDS: usize = 5;

/// Generates one `#[tokio::test]` per conformance case, each calling `$setup` (an
/// expression that may `.await`, evaluating to something that dereferences to a
/// [`DistributedLock`](crate::DistributedLock), such as `Arc<dyn DistributedLock>`) to get
/// a fresh client; the two-client cases call it twice, for two independent clients, the
/// cases that close their first client call it once more for each of [`ROUNDS`]
/// rounds, and the crowd case ([`observers_report_each_grant_once`]) five times: four
/// campaigning clients and an observing one.
///
/// The calling crate needs `tokio` with the `macros` and `rt-multi-thread` features as a
/// dev-dependency.
#[cfg_attr(docsrs, doc(cfg(feature = "conformance")))]
#[macro_export]
macro_rules! conformance_suite {
    ($setup:expr) => {
        $crate::conformance_suite!(@cases $setup;
            mutual_exclusion,
            try_lock_under_contention,
            wait_timeout_is_honoured,
            fifo_order,
            release_is_idempotent,
            with_lock_runs_and_releases,
            fixed_lease_expires_and_reports_loss,
            renewing_lease_outlives_its_duration,
            with_lock_cancels_work_on_loss,
            cancelled_acquires_leave_nothing,
            cancelled_grants_and_extensions_leave_nothing,
            dropped_guard_frees_promptly,
            a_release_retried_after_a_dropped_one_is_not_a_loss,
            expiry_after_handoff_passes_the_turn_on,
            contended_fixed_lease_starts_at_grant,
            odd_names_are_independent,
            invalid_input_is_rejected,
            locks_are_not_reentrant,
            rw_requests_are_checked_and_cancellable,
        );
        $crate::conformance_suite!(@pairs $setup;
            mutual_exclusion_across_clients,
            exclusion_is_visible_across_clients,
            try_lock_races_across_clients,
            cancelled_release_frees_the_name,
            cancelled_give_up_leaves_no_waiter,
            list_finds_held_and_waited_names,
            revoke_takes_the_lock_from_its_holder,
            close_releases_and_refuses,
            one_leader_at_a_time,
            observers_see_every_leader_in_order,
            leadership_passes_when_the_leader_is_lost,
            campaigns_are_checked_and_cancellable,
            observations_end_when_the_client_closes,
            never_more_permits_than_the_limit,
            permits_come_back_when_a_lease_ends,
            contended_fixed_lease_permits_start_at_grant,
            fixed_leases_can_be_extended,
            semaphore_requests_are_checked_and_cancellable,
            tokens_grow_after_a_name_was_idle,
            readers_share_and_writers_exclude,
            a_waiting_writer_is_not_starved,
        );
        $crate::conformance_suite!(@rounds $setup;
            acquires_racing_close_are_given_up,
        );
        $crate::conformance_suite!(@crowd $setup;
            observers_report_each_grant_once,
        );
        $crate::conformance_suite!(@owned $setup;
            a_guard_outlives_its_dropped_client,
        );
    };
    (@owned $setup:expr; $($case:ident),+ $(,)?) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let (a, b) = ($setup, $setup);
                $crate::conformance::$case(a, &*b).await;
            }
        )+
    };
    (@crowd $setup:expr; $($case:ident),+ $(,)?) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let clients = [$setup, $setup, $setup, $setup];
                let observer = $setup;
                let campaigners: ::std::vec::Vec<&dyn $crate::DistributedLock> =
                    clients.iter().map(|c| &**c as &dyn $crate::DistributedLock).collect();
                $crate::conformance::$case(&campaigners, &*observer).await;
            }
        )+
    };
    (@rounds $setup:expr; $($case:ident),+ $(,)?) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let b = $setup;
                for _ in 0..$crate::conformance::ROUNDS {
                    let a = $setup;
                    $crate::conformance::$case(&*a, &*b).await;
                }
            }
        )+
    };
    (@pairs $setup:expr; $($case:ident),+ $(,)?) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let (a, b) = ($setup, $setup);
                $crate::conformance::$case(&*a, &*b).await;
            }
        )+
    };
    (@cases $setup:expr; $($case:ident),+ $(,)?) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let lock = $setup;
                $crate::conformance::$case(&*lock).await;
            }
        )+
    };
}

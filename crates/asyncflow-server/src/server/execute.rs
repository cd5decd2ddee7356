//! The one shape every request runner has: the standalone store, each role, and the daemon
//! around them (which notes the leases a request takes or ends).

use asyncflow_core::{StoreError, Wait};
use asyncflow_proto::{Reply, Request};

use super::cells::Payload;
use super::outgoing::ReplyBody;
use super::session::Session;

/// What running a request gives: the reply and what goes with it, or the store's error.
pub type Outcome = Result<(Reply, ReplyBody), StoreError>;

/// Runs requests.
pub trait Execute {
    /// Runs `req` for `session`; `payload` is the frame's payload section.
    fn execute(&self, session: &Session, req: Request, payload: Payload, wait: Wait<'_>)
    -> Outcome;
}

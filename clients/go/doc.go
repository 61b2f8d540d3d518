// Package leasehold is the Go client of Leasehold, a lease coordination
// service: it decides which single run may work on a session right now and
// hands that run a fencing token for its writes.
//
// Hold acquires a session's lease and keeps it alive on the client's one
// shared KeepAlive stream; the lease's Context is cancelled the moment the
// client can no longer vouch for the lease (the server says it is lost, a
// renewal is refused, or the local deadline passes: DESIGN.md L2).
//
// Leader election (DESIGN.md E1) rests on the same leases: an election is a
// session key of the account, Campaign waits until this candidate leads
// it, and the Leadership's term is the grant's fencing token, its Context
// ending before the database deadline as a lease's does. Leader and
// Observe say who leads and every change; RunElection campaigns, leads and
// campaigns again, with client-go's OnStartedLeading, OnStoppedLeading
// (exactly once per term) and OnNewLeader. See clients/go/README.md.
package leasehold

module leasehold.dev/examples/go

go 1.26.0

require (
	google.golang.org/genproto/googleapis/rpc v0.0.0-20261123191846-1e707ab9fbc2
	google.golang.org/grpc v1.85.0
	leasehold.dev/go v0.0.0
)

require (
	golang.org/x/net v0.60.0 // indirect
	golang.org/x/sys v0.48.0 // indirect
	golang.org/x/text v0.42.0 // indirect
	google.golang.org/protobuf v1.36.12 // indirect
)

// The client module from this repository; a project of its own requires
// leasehold.dev/go at a released version instead.
replace leasehold.dev/go => ../../clients/go

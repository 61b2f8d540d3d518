// Command porcupine checks a fault or HA suite history (docs/testing.md, "The
// history") with Porcupine, a linearizability checker written outside this
// project, against a model of one key's fencing tokens: a register of the
// highest token. A grant answered ok (Acquire) and a Get answered with a held
// lease each show a token; in a linearization each token is at least the
// register's, and becomes it. So no grant hands out a token below one granted
// before it in real time (a run granted again keeps its token), and no Get
// shows an older lease than one already granted. Operations whose outcome is
// unknown, refusals, renewals and writes carry no claim on the register and
// are left out; keys are checked apart.
//
//	cd test/faults/porcupine && go run . ../../../test-results/faults-history.jsonl
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"time"

	"github.com/anishathalye/porcupine"
)

// event is the part of a history line this check reads.
type event struct {
	Type    string          `json:"type"`
	F       string          `json:"f"`
	Process json.RawMessage `json:"process"`
	Time    int64           `json:"time"`
	Key     string          `json:"key"`
	Token   *int64          `json:"token"`
	Value   struct {
		Held bool `json:"held"`
	} `json:"value"`
}

// claim is an operation's input: the token it showed for its key.
type claim struct {
	key   string
	kind  string
	token int64
}

var model = porcupine.Model{
	Partition: func(history []porcupine.Operation) [][]porcupine.Operation {
		byKey := map[string][]porcupine.Operation{}
		for _, op := range history {
			key := op.Input.(claim).key
			byKey[key] = append(byKey[key], op)
		}
		parts := make([][]porcupine.Operation, 0, len(byKey))
		for _, ops := range byKey {
			parts = append(parts, ops)
		}
		return parts
	},
	Init: func() any { return int64(0) },
	Step: func(state, input, _ any) (bool, any) {
		highest, c := state.(int64), input.(claim)
		if c.token < highest {
			return false, highest
		}
		return true, c.token
	},
	DescribeOperation: func(input, _ any) string {
		c := input.(claim)
		return fmt.Sprintf("%s %s %d", c.kind, c.key, c.token)
	},
}

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: porcupine HISTORY.jsonl")
		os.Exit(2)
	}
	ops, counts, err := read(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	result := porcupine.CheckOperationsTimeout(model, ops, time.Minute)
	fmt.Printf("%s: %d grants, %d Gets of a held lease: %s\n", os.Args[1], counts["grant"], counts["get"], result)
	if result != porcupine.Ok {
		os.Exit(1)
	}
}

// read pairs each completion with its process's invocation and keeps the ok
// grants and the Gets that showed a held lease.
func read(path string) ([]porcupine.Operation, map[string]int, error) {
	file, err := os.Open(path)
	if err != nil {
		return nil, nil, err
	}
	defer file.Close()
	lines := bufio.NewScanner(file)
	lines.Buffer(make([]byte, 1<<20), 1<<24)
	invoked := map[int64]event{}
	counts := map[string]int{}
	var ops []porcupine.Operation
	for lines.Scan() {
		var e event
		if err := json.Unmarshal(lines.Bytes(), &e); err != nil {
			return nil, nil, fmt.Errorf("%s: %w", path, err)
		}
		var process int64
		// Notes and the lease_events rows have no numeric process.
		if json.Unmarshal(e.Process, &process) != nil {
			continue
		}
		if e.Type == "invoke" {
			invoked[process] = e
			continue
		}
		call, ok := invoked[process]
		delete(invoked, process)
		if !ok || e.Type != "ok" || e.Token == nil {
			continue
		}
		kind := e.F
		if kind == "acquire" {
			kind = "grant"
		} else if kind != "get" || !e.Value.Held {
			continue
		}
		counts[kind]++
		ops = append(ops, porcupine.Operation{
			ClientId: int(process),
			Input:    claim{key: e.Key, kind: kind, token: *e.Token},
			Call:     call.Time,
			Return:   e.Time,
		})
	}
	return ops, counts, lines.Err()
}

package leasehold_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// recipeProgram is the program the recipe's module builds: it holds a
// session's lease through the library and releases it.
const recipeProgram = `package main

import (
	"context"
	"fmt"
	"os"
	"time"

	leasehold "leasehold.dev/go"
)

func main() {
	ctx := context.Background()
	client, err := leasehold.Dial(ctx, []string{os.Getenv("LEASEHOLD_ADDR")}, leasehold.WithToken(os.Getenv("LEASEHOLD_TOKEN")))
	if err != nil {
		panic(err)
	}
	defer client.Close()
	key := leasehold.SessionKey{AccountID: os.Getenv("LEASEHOLD_ACCOUNT"), SessionID: os.Getenv("LEASEHOLD_SESSION")}
	lease, err := client.Hold(ctx, key, leasehold.HoldOptions{TTL: 10 * time.Second, Holder: "recipe"})
	if err != nil {
		panic(err)
	}
	fmt.Println("held by", lease.Lease().GetHolder())
	fmt.Println("released:", lease.Release(ctx) == nil)
}
`

// recipe is the shell block of README.md that uses the library from a
// checkout: its lines, each one command.
func recipe(t *testing.T) []string {
	t.Helper()
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, block := range strings.Split(string(readme), "```sh\n")[1:] {
		body, _, _ := strings.Cut(block, "```")
		if !strings.Contains(body, "go mod edit -replace") {
			continue
		}
		var lines []string
		for _, line := range strings.Split(body, "\n") {
			if line = strings.TrimSpace(line); line != "" {
				lines = append(lines, line)
			}
		}
		return lines
	}
	t.Fatal("README.md has no sh block with `go mod edit -replace`, want the recipe")
	return nil
}

// The README's recipe for using the library from a checkout (go get of
// leasehold.dev/go alone fails: no proxy serves the path) works as
// written: in a new module in a temporary folder outside the repository,
// its commands (with the checkout's path) let a program on the library be
// built and run against a lease server.
func TestGoGetRecipeInANewModule(t *testing.T) {
	checkout, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if strings.HasPrefix(dir, checkout+string(filepath.Separator)) {
		t.Fatalf("temporary folder %s, want one outside the repository %s", dir, checkout)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	run := func(env []string, name string, args ...string) string {
		t.Helper()
		cmd := exec.CommandContext(ctx, name, args...)
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), env...)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("%s %s: %v, want success:\n%s", name, strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	for _, line := range recipe(t) {
		line = strings.ReplaceAll(line, "/path/to/leasehold", checkout)
		fields := strings.Fields(line)
		if fields[0] != "go" {
			t.Fatalf("recipe line %q, want go commands only", line)
		}
		run(nil, "go", fields[1:]...)
	}
	if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte(recipeProgram), 0o644); err != nil {
		t.Fatal(err)
	}
	run(nil, "go", "build", "-o", "worker", ".")
	key := freshKey(t)
	got := run([]string{
		"LEASEHOLD_ADDR=" + shared.Addr,
		"LEASEHOLD_TOKEN=" + token(time.Hour),
		"LEASEHOLD_ACCOUNT=" + key.AccountID,
		"LEASEHOLD_SESSION=" + key.SessionID,
	}, filepath.Join(dir, "worker"))
	if want := "held by recipe\nreleased: true\n"; got != want {
		t.Fatalf("the program printed %q, want %q", got, want)
	}
}

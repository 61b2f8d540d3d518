// The request side of a client stream: messages pushed whenever the client
// decides to send, read by the transport as an async iterable.

/** A push-driven async iterable: `push` sends, `end` half-closes the stream. */
export class RequestQueue<T> implements AsyncIterable<T> {
  private readonly buffered: T[] = [];
  private waiting: ((result: IteratorResult<T>) => void) | undefined;
  private ended = false;

  /** Queues a message; dropped once the queue has ended. */
  push(message: T): void {
    if (this.ended) return;
    const waiting = this.waiting;
    if (waiting) {
      this.waiting = undefined;
      waiting({ value: message, done: false });
    } else {
      this.buffered.push(message);
    }
  }

  /** Ends the request stream after the queued messages. */
  end(): void {
    this.ended = true;
    const waiting = this.waiting;
    if (waiting && this.buffered.length === 0) {
      this.waiting = undefined;
      waiting({ value: undefined, done: true });
    }
  }

  [Symbol.asyncIterator](): AsyncIterator<T> {
    return {
      next: () => {
        const message = this.buffered.shift();
        if (message !== undefined) return Promise.resolve({ value: message, done: false });
        if (this.ended) return Promise.resolve({ value: undefined, done: true });
        return new Promise((resolve) => {
          this.waiting = resolve;
        });
      },
      return: () => {
        this.end();
        return Promise.resolve({ value: undefined, done: true });
      },
      // Connect calls throw() on the request side when the call fails.
      throw: () => {
        this.end();
        return Promise.resolve({ value: undefined, done: true });
      },
    };
  }
}

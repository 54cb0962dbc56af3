/**
 * `@leasehold/sdk`: the client of leasehold's public API. The agent side is
 * `@leasehold/sdk/agent`, the LangGraph checkpointer `@leasehold/sdk/langgraph`.
 */

export {
  Client,
  type ClientOptions,
  type LeaseholdEvent,
  type Multitask,
  type ReconnectInfo,
  type RetryPolicy,
  type SessionInfo,
  type StreamOptions,
  type TurnAnswer,
  type TurnInfo,
  type TurnOptions,
  type TurnResult,
  type TurnState,
} from "./client.js";
export {
  Busy,
  ConnectionError,
  Fenced,
  HttpError,
  IdempotencyKeyReused,
  Interrupted,
  LeaseholdError,
  OwnerFailed,
  RetryBudgetExhausted,
  SidecarRefused,
  StreamOverflow,
  type RetryDirective,
} from "./errors.js";
export { SseParser, type SseFrame } from "./sse.js";
